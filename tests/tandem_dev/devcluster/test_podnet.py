"""Dev-cluster pods in network namespaces of their own (tandem_dev/devcluster/podnet.py), without the control plane.

Runs inside the suite's loopback-only namespace (scripts/in-netns.sh), on a pod range of its own (not the dev
cluster's 127.10.0.0/16), and removes what it made.
"""

from __future__ import annotations

import socket
import subprocess
import sys
import time
from collections.abc import Iterator
from pathlib import Path

import pytest

from tandem_dev.devcluster.podnet import PodNetwork, PodNetworkError, Sandbox, interfaces
from tandem_dev.procs import ManagedProcess
from tests.plumbing.ci_skips import UNRUNNABLE

pytestmark = [pytest.mark.netns, pytest.mark.timeout(60)]
CIDR = "127.11.0.0/24"
PORT = 23456  # the same port in every pod, as Mooncake's fixed RPC range would be
# A server that binds every interface (as Mooncake does) and answers each connection with its pod's name.
SERVER = (
    "import socket,sys\n"
    "s=socket.socket(); s.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)\n"
    f"s.bind(('0.0.0.0', {PORT})); s.listen(); print('listening', flush=True)\n"
    "while True:\n"
    "    c,_=s.accept(); c.sendall(sys.argv[1].encode()); c.close()\n"
)


@pytest.fixture
def network() -> Iterator[PodNetwork]:
    net = PodNetwork(CIDR).create()
    try:
        yield net
    finally:
        net.delete()


def _serve(sandbox: Sandbox, name: str, tmp_path: Path, procs: list[ManagedProcess]) -> None:
    argv = sandbox.exec_argv([sys.executable, "-c", SERVER, name])
    proc = ManagedProcess(f"server-{name}", argv, tmp_path / f"{name}.log").start()
    procs.append(proc)
    deadline = time.monotonic() + 20
    while "listening" not in proc.log_tail():
        assert proc.alive(), proc.log_tail()
        assert time.monotonic() < deadline, proc.log_tail()
        time.sleep(0.02)


def _ask(ip: str, timeout: float = 2.0) -> str:
    with socket.create_connection((ip, PORT), timeout=timeout) as conn:
        return conn.recv(64).decode()


def _ask_from(sandbox: Sandbox, ip: str) -> str:
    code = f"import socket; c=socket.create_connection(('{ip}', {PORT}), timeout=2); print(c.recv(64).decode())"
    result = subprocess.run(sandbox.exec_argv([sys.executable, "-c", code]), capture_output=True, text=True)
    assert result.returncode == 0, result.stderr
    return result.stdout.strip()


def test_two_pods_bind_the_same_wildcard_port_and_everyone_reaches_each_by_its_ip(
    network: PodNetwork, tmp_path: Path
) -> None:
    procs: list[ManagedProcess] = []
    a = network.start_sandbox("ns/a", "uid-a", "127.11.0.1", tmp_path)
    b = network.start_sandbox("ns/b", "uid-b", "127.11.0.2", tmp_path)
    try:
        _serve(a, "a", tmp_path, procs)
        _serve(b, "b", tmp_path, procs)  # would fail with EADDRINUSE if the pods shared a namespace
        assert (_ask("127.11.0.1"), _ask("127.11.0.2")) == ("a", "b")  # from the host side (the control plane)
        assert _ask_from(a, "127.11.0.2") == "b"  # pod to pod
        assert _ask_from(a, "127.0.0.1") == "a"  # a pod's loopback is its own
        code = "import socket; print(socket.gethostname(), socket.gethostbyname(socket.gethostname()))"
        named = subprocess.run(b.exec_argv([sys.executable, "-c", code]), capture_output=True, text=True, check=True)
        assert named.stdout.split() == ["b", "127.11.0.2"]  # its hostname and /etc/hosts, as the kubelet writes them
        with pytest.raises(OSError, match=r"timed out|unreachable"):
            _ask("127.11.0.3", timeout=0.5)  # no pod there: nothing answers on the bridge
    finally:
        for proc in procs:
            proc.stop()
        a.stop()
        b.stop()
    assert not {a.veth, b.veth} & interfaces()  # the veths went with the namespaces


def test_a_stopped_pod_leaves_the_bridge_at_once_even_while_its_namespace_lives_on(
    network: PodNetwork, tmp_path: Path
) -> None:
    """The kernel tears a namespace down when it likes (here: a process still inside it); the pod's link must not
    wait for that, or the next pod given the same IP (kwok reuses them at once) shares it with the dead one."""
    procs: list[ManagedProcess] = []
    old = network.start_sandbox("ns/old", "uid-old", "127.11.0.1", tmp_path)
    try:
        _serve(old, "old", tmp_path, procs)  # not stopped with the sandbox: it keeps the old namespace alive
        old.stop()
        assert old.veth not in interfaces()
        new = network.start_sandbox("ns/new", "uid-new", "127.11.0.1", tmp_path)
        try:
            _serve(new, "new", tmp_path, procs)
            assert {_ask("127.11.0.1") for _ in range(20)} == {"new"}
        finally:
            new.stop()
    finally:
        for proc in procs:
            proc.stop()
        old.stop()


def test_a_peer_pod_reaches_the_next_pod_on_a_reused_ip_within_seconds(network: PodNetwork, tmp_path: Path) -> None:
    """A peer that talked to the dead pod maps its IP to the dead MAC; it must find the new pod on that IP within
    seconds (it took 38-47 s with the kernel's default neighbour timers: the dev-cluster chaos run's decodes lost a
    recreated prefill for about 30 s). The host side is flushed at once; this is pod to pod."""
    procs: list[ManagedProcess] = []
    old = network.start_sandbox("ns/old", "uid-old", "127.11.0.1", tmp_path)
    peer = network.start_sandbox("ns/peer", "uid-peer", "127.11.0.2", tmp_path)
    new = None
    try:
        _serve(old, "old", tmp_path, procs)
        assert _ask_from(peer, "127.11.0.1") == "old"  # the peer's neighbour entry: the old pod's MAC
        old.stop()
        new = network.start_sandbox("ns/new", "uid-new", "127.11.0.1", tmp_path)
        _serve(new, "new", tmp_path, procs)
        started = time.monotonic()
        code = f"import socket; print(socket.create_connection(('127.11.0.1', {PORT}), timeout=1).recv(64).decode())"
        while True:
            answer = subprocess.run(peer.exec_argv([sys.executable, "-c", code]), capture_output=True, text=True)
            if answer.returncode == 0:
                break
            assert time.monotonic() - started < 15, "the peer still cannot reach the new pod on the reused IP"
        assert answer.stdout.strip() == "new"
    finally:
        for proc in procs:
            proc.stop()
        for sandbox in (old, peer, new):
            if sandbox is not None:
                sandbox.stop()


def test_a_cut_link_isolates_one_pod_until_restored(network: PodNetwork, tmp_path: Path) -> None:
    procs: list[ManagedProcess] = []
    a = network.start_sandbox("ns/a", "uid-a", "127.11.0.1", tmp_path)
    b = network.start_sandbox("ns/b", "uid-b", "127.11.0.2", tmp_path)
    try:
        _serve(a, "a", tmp_path, procs)
        _serve(b, "b", tmp_path, procs)
        a.cut_link()
        with pytest.raises(OSError, match=r"timed out|unreachable"):
            _ask("127.11.0.1", timeout=0.5)
        assert _ask("127.11.0.2") == "b"  # the other pod is untouched
        a.clear_faults()
        assert _ask("127.11.0.1") == "a"
    finally:
        for proc in procs:
            proc.stop()
        a.stop()
        b.stop()


def _fetch_seconds(sandbox: Sandbox, ip: str, port: int, nbytes: int) -> float:
    code = (
        "import socket,time\n"
        f"c=socket.create_connection(('{ip}', {port}), timeout=30); t=time.monotonic(); n=0\n"
        f"while n < {nbytes}:\n"
        "    d=c.recv(65536)\n"
        "    if not d: break\n"
        "    n+=len(d)\n"
        "print(time.monotonic()-t)\n"
    )
    result = subprocess.run(sandbox.exec_argv([sys.executable, "-c", code]), capture_output=True, text=True)
    assert result.returncode == 0, result.stderr
    return float(result.stdout)


def test_a_rate_limit_slows_what_the_pod_sends(network: PodNetwork, tmp_path: Path) -> None:
    """1 MiB from pod a to pod b through an 8 Mbit/s token bucket takes about 1 s (unlimited: milliseconds)."""
    nbytes, port = 1 << 20, 23457
    sender = f"import socket; s=socket.create_server(('0.0.0.0', {port})); print('listening', flush=True)\n"
    sender += f"while True:\n    c,_=s.accept(); c.sendall(b'x'*{nbytes}); c.close()\n"
    a = network.start_sandbox("ns/a", "uid-a", "127.11.0.1", tmp_path)
    b = network.start_sandbox("ns/b", "uid-b", "127.11.0.2", tmp_path)
    proc = ManagedProcess("sender", a.exec_argv([sys.executable, "-c", sender]), tmp_path / "sender.log").start()
    try:
        while "listening" not in proc.log_tail():
            assert proc.alive(), proc.log_tail()
            time.sleep(0.02)
        free = _fetch_seconds(b, "127.11.0.1", port, nbytes)
        a.limit_rate("8mbit")
        limited = _fetch_seconds(b, "127.11.0.1", port, nbytes)
        a.clear_faults()
        print(f"\n1 MiB pod to pod: {free * 1000:.0f} ms free, {limited * 1000:.0f} ms at 8 Mbit/s")
        assert limited > 0.5 > free
    finally:
        proc.stop()
        a.stop()
        b.stop()


def _netem_available() -> bool:
    probe = subprocess.run(
        ["unshare", "--net", "tc", "qdisc", "add", "dev", "lo", "root", "netem", "delay", "1ms"], capture_output=True
    )
    return probe.returncode == 0


@pytest.mark.skipif(
    not _netem_available(),
    reason=f"{UNRUNNABLE} the kernel of this project's machines (and CI's) has no sch_netem"
    " (CONFIG_NET_SCH_NETEM), which tc latency needs; the link-cut and rate-limit faults are tested above",
)
def test_added_latency_delays_the_pods_answers(network: PodNetwork, tmp_path: Path) -> None:
    procs: list[ManagedProcess] = []
    a = network.start_sandbox("ns/a", "uid-a", "127.11.0.1", tmp_path)
    try:
        _serve(a, "a", tmp_path, procs)
        began = time.monotonic()
        _ask("127.11.0.1")
        free = time.monotonic() - began
        a.add_latency(200)
        began = time.monotonic()
        assert _ask("127.11.0.1") == "a"
        delayed = time.monotonic() - began
        print(f"\nconnect + answer: {free * 1000:.0f} ms free, {delayed * 1000:.0f} ms with 200 ms added")
        assert delayed >= 0.2 > free
    finally:
        for proc in procs:
            proc.stop()
        a.stop()


def test_the_pod_network_is_made_only_in_a_namespace_of_its_own() -> None:
    script = (
        "ip link add foreign0 type veth peer name foreign1 && "
        f"{sys.executable} -c 'from tandem_dev.devcluster.podnet import PodNetwork; PodNetwork(\"{CIDR}\").create()'"
    )
    result = subprocess.run(["unshare", "--net", "sh", "-c", script], capture_output=True, text=True)
    assert result.returncode != 0
    assert "loopback-only network namespace of its own, and this one has foreign0, foreign1" in result.stderr


def test_a_second_network_on_the_same_range_is_refused(network: PodNetwork) -> None:
    with pytest.raises(PodNetworkError, match="already exists"):
        PodNetwork(CIDR).create()
