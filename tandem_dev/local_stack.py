"""``tandem up``: the embedded local stack. etcd, 2 prefill + 2 decode simulated workers registered in etcd the
way the operator registers pods (``tandem.leased_writer``, one lease), and the router on 127.0.0.1:8000.

etcd is secured as the chart secures it (``secure=True``, the default): a CA and certificates of its own under
``workdir/pki`` (``tandem_dev.etcd_pki``), TLS, one etcd user per component (``tandem.etcd_auth``), endpoints signed
with the operator's key and verified by the router (``tandem.registry_signing``).

A supervisor restarts a worker that dies: its registry key is deleted at once (the router stops sending to it),
and it is registered again, with a new epoch, once its ``/health`` answers. With ``deregister_dead=False`` the key
stays, as when nobody has noticed the death yet (a partitioned node): only the router's breakers keep traffic off.
It restarts a dead etcd member too, on its ports and data; the writer puts the workers' keys back by itself if etcd
lost its lease meanwhile.
Ctrl-C (or SIGTERM) stops the router first, then the workers, then etcd, each by process group. ``LocalStack`` is
also the tests' fixture.
"""

from __future__ import annotations

import asyncio
import contextlib
import dataclasses
import shutil
import sys
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from pathlib import Path

from tandem import registry
from tandem.etcd_auth import OPERATOR_USER, ROOT_USER, setup_auth
from tandem.etcd_errors import EtcdError
from tandem.leased_writer import LeasedWriter
from tandem.registry import Endpoint, FabricMode, Role
from tandem.registry_signing import EndpointSigner, registry_entry
from tandem_dev.devcluster.pki import CertPair
from tandem_dev.etcd_pki import EtcdPki, create_etcd_pki
from tandem_dev.procs import ManagedProcess, ProcessFailedError, free_port

HOST = "127.0.0.1"
NAMESPACE = "local"
CLUSTER = "tandem"
MODEL = "tandem/sim-model"
# What the operator sets on every pod by default (PDCluster spec.transfer: metadataRefreshSeconds,
# failedSessionProbeSeconds, failedSessionProbeMaxSeconds; a test keeps them equal): a worker that comes back under
# a Mooncake session id its peers still hold is reached again within seconds (operator/README.md).
RECOVERY_ENV = {
    "MC_TE_METADATA_REFRESH_INTERVAL_SECONDS": "2",
    "SGLANG_FAILED_SESSION_PROBE_INTERVAL_S": "1",
    "SGLANG_FAILED_SESSION_PROBE_MAX_INTERVAL_S": "4",
}


def start_etcd(workdir: Path, name: str = "etcd", secure: bool = False) -> tuple[ManagedProcess, str]:
    """A single-member etcd on loopback with its data under ``workdir``; returns it and its ``host:port``."""
    ((proc, endpoint),) = start_etcd_cluster(workdir, 1, name, secure=secure)
    return proc, endpoint


def start_etcd_cluster(
    workdir: Path, members: int, name: str = "etcd", secure: bool = False
) -> list[tuple[ManagedProcess, str]]:
    """``members`` etcd processes on loopback forming one cluster (``name``, or ``name-0`` ... when several), data
    under ``workdir``; returns each member and its client ``host:port``. A member's ``stop()`` then ``start()``
    restarts it on the same ports and data. ``secure``: server and peer TLS with client certificates required, the
    PKI under ``workdir/pki`` (``etcd_pki_of``); auth is turned on separately (``tandem.etcd_auth``)."""
    etcd = shutil.which("etcd")
    if etcd is None:
        raise ProcessFailedError("etcd is not installed (Debian package etcd-server; scripts/bootstrap.sh installs it)")
    names = [name] if members == 1 else [f"{name}-{i}" for i in range(members)]
    ports = [(free_port(), free_port()) for _ in names]
    pki = create_etcd_pki(workdir / "pki", names, HOST) if secure else None
    scheme = "https" if secure else "http"
    cluster = ",".join(f"{member}={scheme}://{HOST}:{peer}" for member, (_, peer) in zip(names, ports, strict=True))
    started: list[tuple[ManagedProcess, str]] = []
    for member, (client, peer) in zip(names, ports, strict=True):
        client_url, peer_url = f"{scheme}://{HOST}:{client}", f"{scheme}://{HOST}:{peer}"
        argv = [
            etcd, "--name", member, "--data-dir", str(workdir / f"{member}.data"),
            "--listen-client-urls", client_url, "--advertise-client-urls", client_url,
            "--listen-peer-urls", peer_url, "--initial-advertise-peer-urls", peer_url,
            "--initial-cluster", cluster, "--log-level", "warn",
        ]  # fmt: skip
        if pki is not None:
            cert, key, ca = str(pki.member(member).cert), str(pki.member(member).key), str(pki.ca.cert)
            argv += ["--cert-file", cert, "--key-file", key, "--trusted-ca-file", ca, "--client-cert-auth"]
            argv += ["--peer-cert-file", cert, "--peer-key-file", key, "--peer-trusted-ca-file", ca]
            argv += ["--peer-client-cert-auth"]
        started.append((ManagedProcess(member, argv, workdir / f"{member}.log").start(), f"{HOST}:{client}"))
    context = pki.ssl_context() if pki is not None else None
    for proc, endpoint in started:  # healthy once the members have elected a leader
        proc.wait_http(f"{scheme}://{endpoint}/health", timeout=30, context=context)
    return started


def etcd_pki_of(workdir: Path) -> EtcdPki:
    """The PKI ``start_etcd_cluster(..., secure=True)`` made under ``workdir``."""
    return EtcdPki(workdir / "pki", CertPair(workdir / "pki" / "ca.crt", workdir / "pki" / "ca.key"))


WorkerArgv = Callable[[Role, int, int | None], list[str]]


def sim_worker_argv(role: Role, port: int, bootstrap_port: int | None) -> list[str]:
    """``tandem sim`` in PD mode, as the operator would launch SGLang."""
    argv = [
        sys.executable,
        "-m",
        "tandem.cli",
        "sim",
        "--model-path",
        MODEL,
        "--host",
        HOST,
        "--port",
        str(port),
        "--disaggregation-mode",
        role.value,
        "--disaggregation-transfer-backend",
        "mooncake",
        "--enable-metrics",
    ]
    if bootstrap_port is not None:
        argv += ["--disaggregation-bootstrap-port", str(bootstrap_port)]
    return argv


def deterministic_sim_worker_argv(role: Role, port: int, bootstrap_port: int | None) -> list[str]:
    """``sim_worker_argv`` with ``--enable-deterministic-inference`` (batch-invariant answers): for runs that judge
    every answer by text equality with the uninterrupted one (chaos), as a user wanting that guarantee runs SGLang."""
    return [*sim_worker_argv(role, port, bootstrap_port), "--enable-deterministic-inference"]


def instant_worker_argv(role: Role, port: int, bootstrap_port: int | None) -> list[str]:
    """The router's instant PD worker (no KV transfer): for tests of discovery and supervision alone."""
    return [
        sys.executable,
        "-m",
        "tandem_dev.router.instant_worker",
        "--role",
        role.value,
        "--host",
        HOST,
        "--port",
        str(port),
    ]


@dataclass
class Worker:
    role: Role
    group: str
    port: int
    bootstrap_port: int | None
    proc: ManagedProcess
    epoch: int = 0
    registered: bool = False
    fabric_domain: str | None = None  # the registry entry's RDMA fabric domain (as the operator reads a node label)
    fabric_mode: FabricMode | None = None

    @property
    def url(self) -> str:
        return f"http://{HOST}:{self.port}"

    def endpoint(self, model: str) -> Endpoint:
        return Endpoint(
            role=self.role,
            group=self.group,
            url=self.url,
            bootstrap_port=self.bootstrap_port,
            model=model,
            epoch=self.epoch,
            fabric_domain=self.fabric_domain,
            fabric_mode=self.fabric_mode,
        )


@dataclass
class LocalStack:
    workdir: Path
    prefills: int = 2
    decodes: int = 2
    router_port: int = 8000  # 0: a free port
    worker_argv: WorkerArgv = sim_worker_argv
    model: str = MODEL
    say: Callable[[str], None] = print
    router_args: Sequence[str] = ()
    restart: bool = True  # False: a dead worker is only deregistered (tests that check it stops getting traffic)
    deregister_dead: bool = True  # False: a dead worker's registry key stays (tests of the router's own breakers)
    worker_env: dict[str, str] = field(default_factory=dict)
    etcd_members: int = 1
    restart_etcd: bool = True  # False: a dead etcd member stays dead (the chaos run restarts it itself)
    lease_ttl: int = 5  # of the workers' registry keys
    fabric_domains: dict[str, str] = field(default_factory=dict)  # group -> the fabric domain its entry carries
    fabric_mode: FabricMode | None = None  # what every entry says (PDCluster spec.fabric.mode), None: nothing
    secure: bool = True  # etcd with TLS, client certificates and roles; signed endpoints (tandem.etcd_auth)
    etcds: list[ManagedProcess] = field(default_factory=list)
    etcd_endpoints: list[str] = field(default_factory=list)
    workers: list[Worker] = field(default_factory=list)
    router: ManagedProcess | None = None
    writer: LeasedWriter | None = None
    signer: EndpointSigner | None = None
    restarts: int = 0
    etcd_restarts: int = 0

    @property
    def router_url(self) -> str:
        return f"http://{HOST}:{self.router_port}"

    async def start(self) -> None:
        if self.router_port == 0:
            self.router_port = free_port()
        self.say("starting etcd ...")
        members = await asyncio.to_thread(start_etcd_cluster, self.workdir, self.etcd_members, "etcd", self.secure)
        self.etcds = [proc for proc, _ in members]
        self.etcd_endpoints = [endpoint for _, endpoint in members]
        router_security: list[str] = []
        if self.secure:
            pki = etcd_pki_of(self.workdir)
            await setup_auth(self.etcd_endpoints, pki.client_tls(ROOT_USER), [(NAMESPACE, CLUSTER)])
            self.writer = LeasedWriter(self.etcd_endpoints, self.lease_ttl, tls=pki.client_tls(OPERATOR_USER))
            self.signer = EndpointSigner.from_file(pki.signing_key)
            router_security = pki.router_flags()
        else:
            self.writer = LeasedWriter(self.etcd_endpoints, self.lease_ttl)
        await self.writer.start()
        for role, count in ((Role.PREFILL, self.prefills), (Role.DECODE, self.decodes)):
            for i in range(count):
                bootstrap = free_port() if role is Role.PREFILL else None
                group = f"{role.value}-{i}"
                port = free_port()
                argv = self.worker_argv(role, port, bootstrap)
                env = {**RECOVERY_ENV, **self.worker_env}
                proc = ManagedProcess(group, argv, self.workdir / f"{group}.log", env=env)
                domain, mode = self.fabric_domains.get(group), self.fabric_mode
                self.workers.append(Worker(role, group, port, bootstrap, proc, fabric_domain=domain, fabric_mode=mode))
        self.say(f"starting {self.prefills} prefill + {self.decodes} decode workers ...")
        for w in self.workers:
            w.proc.start()
        await asyncio.gather(*(self._register_when_healthy(w) for w in self.workers))
        self.say(f"starting the router on {self.router_url} ...")
        argv = [
            sys.executable,
            "-m",
            "tandem.cli",
            "router",
            "--host",
            HOST,
            "--port",
            str(self.router_port),
            "--discovery",
            "etcd",
            *(arg for endpoint in self.etcd_endpoints for arg in ("--etcd-endpoint", endpoint)),
            "--cluster-namespace",
            NAMESPACE,
            "--cluster-name",
            CLUSTER,
            *router_security,
            *self.router_args,
        ]
        self.router = ManagedProcess("router", argv, self.workdir / "router.log").start()
        await asyncio.to_thread(self.router.wait_http, f"{self.router_url}/readiness", 60.0)

    async def _register_when_healthy(self, w: Worker, etcd_may_be_away: bool = False) -> None:
        await asyncio.to_thread(w.proc.wait_http, f"{w.url}/health", 120.0)
        assert self.writer is not None
        try:
            await self.writer.put(*registry_entry(NAMESPACE, CLUSTER, w.endpoint(self.model), self.signer))
        except EtcdError as err:  # a restart while etcd is away: the writer puts the key once etcd answers
            if not etcd_may_be_away:
                raise
            self.say(f"  {w.group}: registration waits for etcd ({err!r})")
        w.registered = True
        self.say(f"  {w.group} ready at {w.url} (epoch {w.epoch})")

    async def supervise(self, stop: asyncio.Event, interval: float = 0.2) -> None:
        """Restart dead workers until ``stop`` is set: deregister at once, restart, re-register when healthy. Restart
        dead etcd members (``restart_etcd``)."""
        pending: set[asyncio.Task[None]] = set()
        etcd_started: dict[str, float] = {}
        while not stop.is_set():
            if self.restart_etcd:
                self._restart_dead_etcds(etcd_started)
            for w in self.workers:
                if w.registered and not w.proc.alive():
                    if self.deregister_dead:
                        assert self.writer is not None
                        try:
                            await self.writer.delete(registry.endpoint_key(NAMESPACE, CLUSTER, w.endpoint(self.model)))
                        except EtcdError as err:  # etcd unreachable for now: the next round tries again
                            self.say(f"  {w.group} exited; deregistering it failed ({err!r}), retrying")
                            continue
                    w.registered = False
                    left = "deregistered" if self.deregister_dead else "its registry key left in place"
                    self.say(f"  {w.group} exited ({w.proc.returncode()}); {left}")
                    w.proc.stop()
                    if not self.restart:
                        continue
                    w.epoch += 1
                    self.restarts += 1
                    if w.role is Role.PREFILL:
                        self._new_bootstrap_port(w)
                    w.proc.start()
                    task = asyncio.create_task(self._register_when_healthy(w, etcd_may_be_away=True))
                    pending.add(task)
                    task.add_done_callback(pending.discard)
            if self.router is not None and not self.router.alive():
                self.say(f"router exited ({self.router.returncode()}):\n{self.router.log_tail()}")
                stop.set()
            with contextlib.suppress(asyncio.TimeoutError):
                await asyncio.wait_for(stop.wait(), interval)
        for task in pending:
            task.cancel()

    def _restart_dead_etcds(self, started: dict[str, float], every_s: float = 1.0) -> None:
        """Start each dead etcd member again, on its ports and data directory (its ``ManagedProcess``: the command
        line never changes), at most once every ``every_s`` per member, so that one that cannot start does not
        spin. Only the member's own process group is touched."""
        now = time.monotonic()
        for member in self.etcds:
            if member.alive() or now - started.get(member.name, -every_s) < every_s:
                continue
            code = member.stop()  # reaps it (and what is left of its group)
            member.start()
            started[member.name] = now
            self.etcd_restarts += 1
            self.say(f"  etcd member {member.name} exited ({code}); restarted on its ports and data")

    def _new_bootstrap_port(self, w: Worker) -> None:
        """A restarted prefill gets another bootstrap port (registered with its new epoch), so decodes meet it as a
        new peer. SGLang's decode caches each bootstrap address's rank ports (``CommonKVReceiver``,
        ``connection_pool`` in ``sglang/srt/disaggregation/common/conn.py``) and drops them only after two missed
        5 s heartbeats (``_handle_node_failure``): a prefill back on the same address within seconds (here, unlike a
        GPU worker reloading its weights for minutes) would get every request stuck waiting for KV that its new,
        randomly bound rank ports never hear about, until ``SGLANG_DISAGGREGATION_WAITING_TIMEOUT`` (300 s)."""
        w.bootstrap_port = free_port()
        w.proc = dataclasses.replace(w.proc, argv=self.worker_argv(w.role, w.port, w.bootstrap_port))

    async def stop(self) -> None:
        if self.router is not None:
            self.router.stop()
        for w in self.workers:
            w.proc.stop()
        if self.writer is not None:
            with contextlib.suppress(Exception):
                await self.writer.close(revoke=True)
        for etcd in self.etcds:
            etcd.stop()
