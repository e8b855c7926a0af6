"""``tandem chaos --setting dev-cluster``: the chaos run on the dev cluster, with the operator.

The setting: the dev cluster (kube-apiserver, controller-manager, scheduler, kwok; ``tandem_dev.devcluster``) whose pod
runner runs each worker pod's ``tandem sim`` in the pod's own network namespace; ``tandem operator`` as 2 replicas
with leader election (a Lease, ``tandem_operator.decide.leader``); the PDCluster of ``deploy/sim-small.yaml`` with 2
prefill and 2 decode groups of one pod each; a 3-member registry etcd; 2 routers discovering workers in it. The load,
the references, the verdicts and the report are the local setting's (``tandem_dev.chaos``); the faults too, with what
differs here:

- ``prefill`` / ``decode``: the pod's container (its ``tandem sim``) is killed (SIGKILL). The operator fences the
  group and recreates it as new pods; recovered when every router has the group's new registered URL available.
- ``router``, ``etcd``, ``transfer``: as in ``tandem_dev.chaos.faults``.
- ``operator``: the replica holding the Lease is killed (SIGKILL: the Lease is not released) and started again at
  once as a standby (a Deployment's ReplicaSet would). Fenced: the other replica holds the Lease. Then a decode's
  container is killed at once: only the new leader can recover it. Recovered: that decode recovered (seconds from
  the leader kill).
"""

from __future__ import annotations

import asyncio
import contextlib
import os
import signal
import ssl
import sys
import time
from collections.abc import AsyncIterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import aiohttp
import yaml
from kubernetes_asyncio import client
from kubernetes_asyncio import config as kube_config

from tandem import registry
from tandem.etcd_errors import EtcdUnavailableError
from tandem.registry import Role
from tandem.registry_etcd import client as etcd_client
from tandem.registry_etcd import close_client
from tandem_dev.chaos.faults import ChaosTarget, Injector, Router
from tandem_dev.chaos.report import ChaosReport, FaultRecord
from tandem_dev.chaos.run import ChaosArgs, measure, say
from tandem_dev.devcluster.cluster import DevCluster
from tandem_dev.devcluster.config import DevClusterConfig
from tandem_dev.devcluster.operator_proc import lease_holder, operator_process
from tandem_dev.devcluster.podrunner import PodRunner
from tandem_dev.local_stack import HOST, start_etcd_cluster
from tandem_dev.procs import ManagedProcess, free_port

SETTING = (
    "dev cluster: operator (2 replicas, leader election), 2 prefill + 2 decode simulated pods, 3-member etcd, 2 routers"
)
REPO = Path(__file__).resolve().parents[2]
MANIFEST = REPO / "deploy" / "sim-small.yaml"
CRDS = REPO / "charts" / "tandem" / "crds"
NAME = "sim"
GROUPS = 2  # per role, one pod each
OPERATORS = ("op-a", "op-b")


def manifest(namespace: str, etcd: list[str], inter_token_ms: float) -> dict[str, Any]:
    """``deploy/sim-small.yaml`` with 2 prefill and 2 decode groups of one pod, the run's etcd and decode step."""
    doc: dict[str, Any] = yaml.safe_load(MANIFEST.read_text())
    doc["metadata"]["namespace"] = namespace
    spec = doc["spec"]
    spec["etcd"]["endpoints"] = [f"http://{e}" for e in etcd]
    spec["decode"].update(nodesPerGroup=1, tpSize=1)
    spec["deterministicInference"] = True  # streams are judged by text equality with the uninterrupted answer
    for role in ("prefill", "decode"):
        spec[role].update(groups=GROUPS, extraArgs=[f"--sim-inter-token-ms={inter_token_ms:g}"])
    return doc


@dataclass
class DevClusterWorkers:
    """The dev cluster as a ``faults.Cluster``: groups' URLs from the registry, containers killed through
    the pod runner (the kubelet), the operators and their Lease."""

    api: client.ApiClient
    namespace: str
    runner: PodRunner
    etcd_members: list[tuple[ManagedProcess, str]]
    operators: dict[str, ManagedProcess]
    etcd: Any = field(default=None)  # the registry reader (aetcd client over every member)

    @property
    def etcds(self) -> list[ManagedProcess]:
        return [proc for proc, _ in self.etcd_members]

    def groups(self, role: Role) -> list[str]:
        return [f"{role.value}-{i}" for i in range(GROUPS)]

    async def endpoints(self) -> dict[str, registry.Endpoint]:
        kvs = await self.etcd.get_prefix(registry.cluster_prefix(self.namespace, NAME).encode())
        return {e.group: e for e in (registry.decode(kv.value) for kv in kvs)}

    async def worker_url(self, group: str) -> str | None:
        try:
            endpoint = (await self.endpoints()).get(group)
        except EtcdUnavailableError:  # the member it asked is down: unknown for now
            return None
        return None if endpoint is None else endpoint.url

    def kill_worker(self, group: str) -> None:
        pod = f"{self.namespace}/{NAME}-{group}-0"
        procs = [proc for launch, proc in self.runner.running.values() if launch.pod == pod]
        if not procs:
            raise RuntimeError(f"no running container for pod {pod}")
        for proc in procs:
            proc.signal(signal.SIGKILL)

    def etcd_health(self, member: ManagedProcess) -> tuple[str, ssl.SSLContext | None]:
        endpoint = next(e for proc, e in self.etcd_members if proc is member)
        return f"http://{endpoint}/health", None

    async def leader(self) -> str | None:
        return await lease_holder(self.api, self.namespace)


@dataclass
class DevClusterTarget(ChaosTarget):
    """The local setting's faults, and the operator leader's (``cluster`` is a ``DevClusterWorkers``)."""

    def injectors(self) -> dict[str, Injector]:
        return {**super().injectors(), "operator": self._kill_leader}

    def victims(self, kind: str) -> list[str]:
        return ["leader"] if kind == "operator" else super().victims(kind)

    async def _kill_leader(self, victim: str, record: FaultRecord) -> None:
        workers = self.cluster
        assert isinstance(workers, DevClusterWorkers)
        holder = await workers.leader()
        if holder not in workers.operators:
            raise RuntimeError(f"no operator replica holds the Lease (holder {holder!r})")
        replica = workers.operators[holder]
        killed = time.monotonic()
        replica.signal(signal.SIGKILL)

        async def taken_over() -> bool:
            return await workers.leader() not in (None, holder)

        record.fenced = await self.until(taken_over, killed)
        await asyncio.to_thread(replica.stop)
        replica.start()  # back as the standby
        if record.fenced is None:
            record.note = f"leader {holder} killed; no other replica took the Lease within {self.cap_s:g} s"
            return
        follow = FaultRecord("decode", "decode-0", time.monotonic() - killed)
        await self.kill_worker(follow.victim, follow)
        if follow.recovered is not None:
            record.recovered = follow.at + follow.recovered
        record.note = (
            f"leader {holder} killed and restarted as standby; fenced: another replica holds the Lease; then "
            f"{follow.victim} killed at once (fenced {_s(follow.fenced)}, recovered {_s(follow.recovered)} after "
            "it); recovered: that decode recovered under the new leader"
        )


def _s(value: float | None) -> str:
    return "never" if value is None else f"{value:.2f} s"


async def _kubectl(cluster: DevCluster, *args: str) -> None:
    proc = await asyncio.create_subprocess_exec(
        str(cluster.tool("kubectl")), *args, env={**os.environ, **cluster.env()},
        stdout=asyncio.subprocess.PIPE, stderr=asyncio.subprocess.STDOUT,
    )  # fmt: skip
    out, _ = await proc.communicate()
    if proc.returncode != 0:
        raise RuntimeError(f"kubectl {' '.join(args)} failed ({proc.returncode}): {out.decode()}")


async def _until(check: Any, what: str, within: float) -> None:
    deadline = time.monotonic() + within
    while not await check():
        if time.monotonic() > deadline:
            raise TimeoutError(f"chaos (dev cluster): {what} not within {within:g} s")
        await asyncio.sleep(0.5)


def _router(etcd: list[str], namespace: str, port: int, log: Path) -> ManagedProcess:
    """``tandem router`` on the cluster's registry, at its defaults (as the chart runs it)."""
    argv = [sys.executable, "-m", "tandem.cli", "router", "--host", HOST, "--port", str(port), "--discovery", "etcd"]
    argv += [arg for endpoint in etcd for arg in ("--etcd-endpoint", endpoint)]
    argv += ["--cluster-namespace", namespace, "--cluster-name", NAME]
    return ManagedProcess(log.stem, argv, log)


@contextlib.asynccontextmanager
async def _processes() -> AsyncIterator[list[ManagedProcess]]:
    procs: list[ManagedProcess] = []
    try:
        yield procs
    finally:
        for proc in reversed(procs):
            await asyncio.to_thread(proc.stop)


async def run_on_cluster(
    args: ChaosArgs, cluster: DevCluster, api: client.ApiClient, namespace: str, workdir: Path
) -> ChaosReport:
    """The run on a started dev cluster with Tandem's CRDs, in ``namespace`` (which exists): it starts the
    registry etcd, the operators, the PDCluster, the pod runner and the routers, and stops all of them."""
    async with _processes() as procs:
        members = await asyncio.to_thread(start_etcd_cluster, workdir / "etcd", 3, "etcd")
        procs += [proc for proc, _ in members]
        etcd = [endpoint for _, endpoint in members]
        operators = {
            identity: operator_process(
                cluster.kubeconfig, namespace, ",".join(f"http://{e}" for e in etcd), workdir, identity,
                leader_election=True,
            ).start()
            for identity in OPERATORS
        }  # fmt: skip
        procs += operators.values()
        await client.CustomObjectsApi(api).create_namespaced_custom_object(
            "tandem.dev", "v1alpha1", namespace, "pdclusters", manifest(namespace, etcd, args.inter_token_ms)
        )
        runner = PodRunner(api, workdir / "pods", namespace=namespace, network=cluster.pod_network)
        async with runner.running_in_background():
            workers = DevClusterWorkers(api, namespace, runner, members, operators, etcd_client(etcd))
            await workers.etcd.connect()
            try:
                return await _serve_and_measure(args, workers, etcd, workdir, procs)
            finally:
                await close_client(workers.etcd)


async def _serve_and_measure(
    args: ChaosArgs, workers: DevClusterWorkers, etcd: list[str], workdir: Path, procs: list[ManagedProcess]
) -> ChaosReport:
    groups = sorted(g for role in Role for g in workers.groups(role))

    async def registered() -> bool:
        return sorted(await workers.endpoints()) == groups

    say(f"waiting for {', '.join(groups)} to be registered by the operator ...")
    await _until(registered, "every group registered", 300)
    say(f"Lease held by {await workers.leader()}; starting 2 routers ...")
    routers = []
    for i in range(2):
        port = free_port()
        proc = _router(etcd, workers.namespace, port, workdir / f"router-{i}.log").start()
        procs.append(proc)
        routers.append(Router(f"http://{HOST}:{port}", proc))
    for router in routers:
        await asyncio.to_thread(router.proc.wait_http, f"{router.url}/readiness", 120.0)

    def target(http: aiohttp.ClientSession) -> ChaosTarget:
        return DevClusterTarget(workers, routers, http, cap_s=args.cap_s)

    served_name = str(manifest(workers.namespace, etcd, 0)["spec"]["model"]["servedName"])
    return await measure(args, SETTING, served_name, routers, target)


async def run_devcluster_chaos(args: ChaosArgs, workdir: Path) -> ChaosReport:
    """Start the dev cluster (in this loopback-only network namespace), apply the CRDs, run, stop it all."""
    cluster = DevCluster(workdir / "k8s", DevClusterConfig(nodes=4))
    say("starting the dev cluster ...")
    try:
        await asyncio.to_thread(cluster.start)
        await _kubectl(cluster, "apply", "--server-side", "-f", str(CRDS))
        await asyncio.to_thread(cluster.wait_established, [path.stem for path in CRDS.glob("*.yaml")])
        api = await kube_config.new_client_from_config(config_file=str(cluster.kubeconfig))
        try:
            core = client.CoreV1Api(api)
            await core.create_namespace(client.V1Namespace(metadata=client.V1ObjectMeta(name="chaos")))

            async def default_account() -> bool:  # pods need it; the controller-manager creates it
                return any(
                    sa.metadata.name == "default" for sa in (await core.list_namespaced_service_account("chaos")).items
                )

            await _until(default_account, "the namespace's default ServiceAccount", 60)
            return await run_on_cluster(args, cluster, api, "chaos", workdir)
        finally:
            await api.close()
    finally:
        await asyncio.to_thread(cluster.stop)
