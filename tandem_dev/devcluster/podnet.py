"""Each simulated pod gets its own network namespace, as on a Kubernetes node.

One bridge per dev cluster carries the pod range; each pod is a *sandbox* (the pause container of a real
kubelet: ``unshare --net --uts --mount ... sleep infinity``) holding a network namespace whose ``eth0`` is one end
of a veth pair, the other end on the bridge, with the pod IP on it, plus the pod's hostname and a kubelet-style
/etc/hosts (so a wildcard ``--host`` resolves its hostname to the pod IP, as SGLang's ``get_local_ip_auto`` does
in a pod). The pod's container runs inside it (``nsenter``) and can be restarted there, keeping the IP. So
ports, wildcard binds (Mooncake binds every interface) and pod IPs behave as on Kubernetes: two pods never
collide.

The pod range stays 127.10.0.0/16: ``route_localnet`` lets 127/8 addresses be routed and ARPed on the bridge and
the veths, and a route for the range in the ``local`` table (longer than the loopback's 127.0.0.0/8) sends it
there. The host side of the bridge (the control plane, the router, the tests) reaches every pod at its IP from
the gateway, the range's last address. All of this exists only inside a network namespace that has nothing but
loopback and what this module made (``require_private_namespace``), e.g. the test suite's
(scripts/in-netns.sh), so nothing is ever routed off the machine.

Network faults for chaos tests: ``Sandbox.cut_link``/``restore_link`` (the pod's veth down/up),
``Sandbox.limit_rate`` (tc tbf) and ``Sandbox.add_latency`` (tc netem; needs ``CONFIG_NET_SCH_NETEM``).
"""

from __future__ import annotations

import contextlib
import hashlib
import ipaddress
import os
import subprocess
import time
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path

from tandem_dev.procs import ManagedProcess

BRIDGE_PREFIX = "tdmbr"
VETH_PREFIX = "tdmv"
POD_INTERFACE = "eth0"
NAMESPACES = (("net", "net"), ("uts", "uts"), ("mount", "mnt"))  # nsenter option, /proc/<pid>/ns/ entry
NET_DEV = Path("/proc/self/net/dev")  # this namespace's interfaces (/sys/class/net shows sysfs's mounter's)
OUR_PREFIXES = (BRIDGE_PREFIX, VETH_PREFIX)


# The pause container: new network, UTS and mount namespaces; the pod's hostname and /etc/hosts; then sleep.
HOLDER = (
    "unshare", "--net", "--uts", "--mount", "--propagation", "private", "--", "sh", "-c",
    'hostname "$1" && mount --bind "$2" /etc/hosts && exec sleep infinity', "sandbox",
)  # fmt: skip


class PodNetworkError(RuntimeError):
    """The pod network cannot be set up here, or a step of it failed (the message names the command)."""


def _run(argv: Sequence[str], stdin: str | None = None) -> None:
    result = subprocess.run(list(argv), input=stdin, capture_output=True, text=True, timeout=30, check=False)
    if result.returncode != 0:
        shown = " ".join(argv) + (f" <<< {stdin.strip()!r}" if stdin else "")
        raise PodNetworkError(f"{shown} failed ({result.returncode}): {result.stderr.strip()}")


def interfaces() -> set[str]:
    """Names of this network namespace's interfaces."""
    lines = NET_DEV.read_text().splitlines()[2:]  # two header lines, then "  name: counters..."
    return {line.split(":", 1)[0].strip() for line in lines}


def foreign_interfaces() -> list[str]:
    """Interfaces of this network namespace other than loopback and the ones this module creates."""
    return sorted(name for name in interfaces() if name != "lo" and not name.startswith(OUR_PREFIXES))


def require_private_namespace() -> None:
    """Refuse to touch a namespace that has any real interface: pod addresses live only in one of our own."""
    if not os.access(ROUTE_LOCALNET, os.W_OK):
        raise PodNetworkError("the pod network needs CAP_NET_ADMIN: run inside scripts/in-netns.sh")
    foreign = foreign_interfaces()
    if foreign:
        raise PodNetworkError(
            f"the pod network is made only inside a loopback-only network namespace of its own, and this one has "
            f"{', '.join(foreign)}: run under scripts/in-netns.sh (unshare -n)"
        )


ROUTE_LOCALNET = "/proc/sys/net/ipv4/conf/all/route_localnet"  # "all" ORs into every interface's setting
ARP_NOTIFY = "/proc/sys/net/ipv4/conf/all/arp_notify"  # likewise the larger of "all" and the interface's
# A pod's neighbour entries: confirmed-reachable for 0.5-1.5 s (not 15-45 s), one unicast probe after 1 s (not 3 after
# 5 s), so a peer whose MAC changed (a reused pod IP) is resolved again within about 2 s (``Sandbox.configure``).
NEIGH_TIMERS = (("base_reachable_time_ms", 1000), ("delay_first_probe_time", 1), ("ucast_solicit", 1))


def _short_hash(text: str, length: int) -> str:
    return hashlib.sha256(text.encode()).hexdigest()[:length]


@dataclass(frozen=True)
class PodNetwork:
    """The bridge of one pod range. ``create()`` it once per cluster; pod runners attach sandboxes to it."""

    cidr: str

    @property
    def network(self) -> ipaddress.IPv4Network:
        return ipaddress.IPv4Network(self.cidr)

    @property
    def bridge(self) -> str:
        return f"{BRIDGE_PREFIX}{_short_hash(self.cidr, 10)}"  # at most 15 characters (IFNAMSIZ)

    @property
    def gateway(self) -> str:
        """The host side's address: the range's last one (kwok counts pod IPs up from the first)."""
        return str(self.network.broadcast_address - 1)

    def exists(self) -> bool:
        return self.bridge in interfaces()

    def create(self) -> PodNetwork:
        require_private_namespace()
        if self.exists():
            raise PodNetworkError(f"bridge {self.bridge} for {self.cidr} already exists (another dev cluster here?)")
        Path(ROUTE_LOCALNET).write_text("1")
        net = self.network
        _run(
            ["ip", "-batch", "-"],
            f"link add {self.bridge} type bridge\n"
            f"addr add {self.gateway}/{net.prefixlen} dev {self.bridge}\n"
            f"link set {self.bridge} up\n"
            f"route replace {net} dev {self.bridge} table local src {self.gateway}\n",
        )
        return self

    def delete(self) -> None:
        """Remove the bridge (and with it its route); veths of live sandboxes drop off it."""
        if self.exists():
            _run(["ip", "link", "del", self.bridge])

    def veth(self, uid: str) -> str:
        return f"{VETH_PREFIX}{_short_hash(uid, 11)}"

    def start_sandbox(self, pod: str, uid: str, ip: str, log_dir: Path) -> Sandbox:
        """Namespaces with ``eth0`` = ``ip`` on the bridge, the pod's hostname and its /etc/hosts (as the kubelet
        writes it: the hostname resolves to the pod IP), held by a sleeping process."""
        if not self.exists():
            raise PodNetworkError(f"no pod network {self.cidr} (bridge {self.bridge}): start the dev cluster first")
        name = f"sandbox-{pod.replace('/', '_')}"
        hostname = pod.rsplit("/", 1)[-1][:63]
        hosts = log_dir / f"{name}-{uid[:8]}.hosts"
        log_dir.mkdir(parents=True, exist_ok=True)
        hosts.write_text(f"# Kubernetes-managed hosts file.\n127.0.0.1\tlocalhost\n{ip}\t{hostname}\n")
        argv = [*HOLDER, hostname, str(hosts)]
        sandbox = Sandbox(pod, ip, self.veth(uid), ManagedProcess(name, argv, log_dir / f"{name}.log").start())
        try:
            sandbox.wait_namespace()
            self._wire(sandbox)
        except BaseException:
            sandbox.stop()
            raise
        return sandbox

    def _wire(self, sandbox: Sandbox) -> None:
        net = self.network
        _run(["ip", "link", "add", sandbox.veth, "type", "veth", "peer", "name", POD_INTERFACE, "netns", sandbox.netns])
        _run(["ip", "link", "set", sandbox.veth, "master", self.bridge, "up"])
        sandbox.configure(
            "link set lo up\n"
            f"addr add {sandbox.ip}/{net.prefixlen} dev {POD_INTERFACE}\n"
            f"link set {POD_INTERFACE} up\n"
            f"route replace {net} dev {POD_INTERFACE} table local src {sandbox.ip}\n"
        )
        # kwok hands a deleted pod's IP to the next pod at once: forget the dead pod's MAC on this side (where
        # the probes, the router and the operator are), as a CNI's gratuitous ARP on IP assignment would.
        _run(["ip", "neigh", "flush", "to", sandbox.ip, "dev", self.bridge])


@dataclass
class Sandbox:
    """One pod's network namespace (held by ``holder``) and the host end ``veth`` of its link."""

    pod: str
    ip: str
    veth: str
    holder: ManagedProcess

    @property
    def netns(self) -> str:
        return f"/proc/{self.holder.pid}/ns/net"

    def wait_namespace(self, timeout: float = 10.0) -> None:
        """Until the holder has set up its namespaces and sleeps."""
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            if not self.holder.alive():
                raise PodNetworkError(f"sandbox of {self.pod} exited: {self.holder.log_tail()}")
            with contextlib.suppress(OSError):
                if Path(f"/proc/{self.holder.pid}/comm").read_text().strip() == "sleep":
                    return
            time.sleep(0.005)
        raise PodNetworkError(f"sandbox of {self.pod}: namespaces not ready after {timeout}s")

    def exec_argv(self, argv: Sequence[str]) -> list[str]:
        """``argv`` run inside the pod's namespaces (network, hostname, mounts), in the current directory."""
        spaces = [f"--{kind}=/proc/{self.holder.pid}/ns/{name}" for kind, name in NAMESPACES]
        return ["nsenter", *spaces, f"--wd={os.getcwd()}", "--", *argv]

    def configure(self, ip_commands: str) -> None:
        """Turn on ``route_localnet`` and ``arp_notify`` inside the namespace (sysctls are per namespace), set its
        ``eth0``'s neighbour timers (``NEIGH_TIMERS``), then run ``ip -batch``. ``arp_notify``: the pod announces its
        IP (gratuitous ARP) when its ``eth0`` comes up, as after a CNI's IP assignment.

        The announcement alone did not move peers here: a pod that still mapped a reused pod IP to the dead pod's
        MAC kept it until the entry went stale and its probes failed, 38-47 s in which the new pod on that IP was
        unreachable from it (measured; the dev-cluster chaos run's decodes lost a recreated prefill for about
        30 s). With ``NEIGH_TIMERS`` a peer re-resolves within about 2 s (measured: 1.4-1.8 s)."""
        timers = " && ".join(f"echo {v} > /proc/sys/net/ipv4/neigh/{POD_INTERFACE}/{k}" for k, v in NEIGH_TIMERS)
        setup = f"echo 1 > {ROUTE_LOCALNET} && echo 1 > {ARP_NOTIFY} && {timers} && exec ip -batch -"
        _run(self.exec_argv(["sh", "-c", setup]), ip_commands)

    def alive(self) -> bool:
        return self.holder.alive()

    # -- network faults ---------------------------------------------------------------------------------------
    def cut_link(self) -> None:
        """The pod's cable pulled: nothing in or out (its own loopback still works)."""
        _run(["ip", "link", "set", self.veth, "down"])

    def restore_link(self) -> None:
        _run(["ip", "link", "set", self.veth, "up"])

    def limit_rate(self, rate: str, burst: str = "32kbit", latency: str = "400ms") -> None:
        """Everything the pod sends goes through a token bucket of ``rate`` (tc tbf, e.g. ``"8mbit"``)."""
        self._qdisc(["tbf", "rate", rate, "burst", burst, "latency", latency])

    def add_latency(self, delay_ms: float, jitter_ms: float = 0.0) -> None:
        """Everything the pod sends is delayed by ``delay_ms`` (tc netem; the kernel needs sch_netem)."""
        self._qdisc(["netem", "delay", f"{delay_ms}ms", *([f"{jitter_ms}ms"] if jitter_ms else [])])

    def clear_faults(self) -> None:
        """Link up and no qdisc of ours on the pod's ``eth0``."""
        self.restore_link()
        result = subprocess.run(
            self.exec_argv(["tc", "qdisc", "del", "dev", POD_INTERFACE, "root"]), capture_output=True, check=False
        )
        if result.returncode != 0 and b"No such file" not in result.stderr and b"Cannot delete" not in result.stderr:
            raise PodNetworkError(f"tc qdisc del on {self.pod}: {result.stderr.decode().strip()}")

    def _qdisc(self, spec: list[str]) -> None:
        _run(self.exec_argv(["tc", "qdisc", "replace", "dev", POD_INTERFACE, "root", *spec]))

    def stop(self) -> None:
        """Take the pod off the bridge, then end its namespace (a CNI's DEL, then the runtime's teardown).

        The link goes first, and synchronously: the kernel tears a network namespace down asynchronously
        (``cleanup_net``), which under load took minutes here, and until then the dead pod's veth stayed on the
        bridge with its IP and answered ARP for it, so a new pod given that IP by kwok lost its traffic to the
        dead one (peers' neighbour entries flipped back to the old MAC)."""
        if self.veth in interfaces():
            subprocess.run(["ip", "link", "del", self.veth], capture_output=True, check=False)  # gone already: fine
        self.holder.stop(timeout=5)
