"""Helpers for the operator's tests on the real control plane: CRDs, operator processes, PDClusters, registry."""

from __future__ import annotations

import asyncio
import contextlib
import copy
import json
import os
import sys
from collections.abc import AsyncIterator, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from kubernetes_asyncio import client

from tandem import registry
from tandem.registry import Endpoint
from tandem.registry_etcd import client as etcd_client
from tandem_dev.devcluster.cluster import DevCluster
from tandem_dev.devcluster.operator_proc import operator_process as devcluster_operator
from tandem_dev.devcluster.podrunner import PodRunner
from tandem_dev.procs import ManagedProcess, free_port
from tests.tandem_dev.devcluster.devcluster_fixtures import eventually

REPO = Path(__file__).resolve().parents[2]
CRDS = REPO / "charts" / "tandem" / "crds"
GROUP, VERSION = "tandem.dev", "v1alpha1"

# deploy/sim-small.yaml adapted to the dev cluster: tcp, 1 GPU per pod, a 2-node decode group.
SIM_SPEC: dict[str, Any] = {
    "model": {"path": "sim/kimi-k2.6-sim", "servedName": "kimi-k2.6-sim"},
    "images": {"worker": "tandem-sglang-worker:0.5.23"},
    "prefill": {"groups": 1, "nodesPerGroup": 1, "gpusPerNode": 1, "tpSize": 1, "epSize": 1, "moeA2ABackend": "none"},
    "decode": {"groups": 1, "nodesPerGroup": 2, "gpusPerNode": 1, "tpSize": 2, "epSize": 1, "moeA2ABackend": "none"},
    "transfer": {"protocol": "tcp"},
    "etcd": {"endpoints": ["http://127.0.0.1:2379"]},
}


def pdcluster(name: str, *, decode_groups: int = 1, **spec: Any) -> dict[str, Any]:
    body = copy.deepcopy(SIM_SPEC)
    body["decode"]["groups"] = decode_groups
    body.update(spec)
    return {"apiVersion": f"{GROUP}/{VERSION}", "kind": "PDCluster", "metadata": {"name": name}, "spec": body}


async def create_pdcluster(api: client.ApiClient, namespace: str, manifest: dict[str, Any]) -> dict[str, Any]:
    created: dict[str, Any] = await client.CustomObjectsApi(api).create_namespaced_custom_object(
        GROUP, VERSION, namespace, "pdclusters", manifest
    )
    return created


async def run_tool(cluster: DevCluster, tool: str, *args: str, check: bool = True) -> tuple[int, str, str]:
    """kubectl/helm of the dev cluster; returns (exit code, stdout, stderr)."""
    proc = await asyncio.create_subprocess_exec(
        str(cluster.tool(tool)),
        *args,
        env={**os.environ, **cluster.env()},
        stdout=asyncio.subprocess.PIPE,
        stderr=asyncio.subprocess.PIPE,
    )
    async with asyncio.timeout(60):
        out, err = await proc.communicate()
    code = proc.returncode
    assert code is not None
    if check:
        assert code == 0, f"{tool} {' '.join(args)} failed ({code}): {err.decode()}{out.decode()}"
    return code, out.decode(), err.decode()


def operator_process(
    cluster: DevCluster, namespace: str, etcd: str, log_dir: Path, identity: str, *, leader_election: bool = False
) -> ManagedProcess:
    """``tandem operator`` serving one namespace (the test's), the registry in the test etcd, resync every 5 s."""
    return devcluster_operator(
        cluster.kubeconfig, namespace, etcd, log_dir, identity, leader_election=leader_election, resync_s=5
    )


def router_process(etcd: str, namespace: str, cluster: str, port: int, log_dir: Path) -> ManagedProcess:
    """``tandem router`` discovering the cluster's workers in the test etcd (round robin, fast health checks)."""
    argv = [sys.executable, "-m", "tandem.cli", "router", "--host", "127.0.0.1", "--port", str(port)]
    argv += ["--discovery", "etcd", "--etcd-endpoint", etcd.split("://", 1)[1]]
    argv += ["--cluster-namespace", namespace, "--cluster-name", cluster, "--health-interval-s", "0.5"]
    argv += ["--policy", "round_robin"]
    return ManagedProcess("router", argv, log_dir / "router.log")


LOAD_CLIENT = Path(__file__).with_name("load_client.py")
SIM_MODEL = "kimi-k2.6-sim"


@dataclass(frozen=True)
class Live:
    """What every live operator test runs on (fixture ``live``): the dev cluster with Tandem's CRDs, a fresh
    namespace, the registry etcd, the test's log directory and its process list (stopped at teardown)."""

    cluster: DevCluster
    api: client.ApiClient
    ns: str
    etcd: str
    tmp: Path
    procs: list[ManagedProcess]


@dataclass
class SimStack:
    """A simulated PDCluster ``sim`` serving through a router: its registry and the router's OpenAI base URL."""

    reg: Registry
    base_url: str
    metrics_url: str
    runner: PodRunner  # acts as the kubelet: probes, container exits (``runner.running``), network faults


@contextlib.asynccontextmanager
async def sim_stack(live: Live, groups: Sequence[str], **spec: Any) -> AsyncIterator[SimStack]:
    """Operator, PDCluster ``sim`` (simulated workers behind pod IPs), pod runner, router: yields once ``groups``
    are registered and a completion goes through the router."""
    cluster, api, namespace, etcd, log_dir, procs = live.cluster, live.api, live.ns, live.etcd, live.tmp, live.procs
    procs.append(operator_process(cluster, namespace, etcd, log_dir, "op").start())
    await create_pdcluster(api, namespace, pdcluster("sim", simulated=True, **spec))
    (log_dir / "pods").mkdir()
    async with (
        PodRunner(api, log_dir / "pods", namespace=namespace).running_in_background() as runner,
        Registry(etcd) as reg,
    ):

        async def registered() -> bool:
            return sorted(await reg.endpoints(namespace, "sim")) == sorted(groups)

        await eventually(registered, f"{', '.join(groups)} registered", within=90)
        port = free_port()
        procs.append(router_process(etcd, namespace, "sim", port, log_dir).start())
        base_url = f"http://127.0.0.1:{port}/v1"
        await eventually(lambda: serves(base_url, SIM_MODEL), "a completion through the router", within=60)
        yield SimStack(reg, base_url, f"http://127.0.0.1:{port}/metrics", runner)


async def start_load(
    base_url: str, model: str, streams: int, seconds: float, max_tokens: int = 16, gaps: bool = False
) -> asyncio.subprocess.Process:
    """Streaming load through the router in its own process (tests/operator/load_client.py; ``gaps``: report every
    client-side token gap too)."""
    argv = [
        str(LOAD_CLIENT),
        base_url,
        model,
        str(streams),
        str(seconds),
        str(max_tokens),
        *(["--gaps"] if gaps else []),
    ]
    env = {**os.environ, "PYTHONPATH": os.pathsep.join(sys.path)}
    return await asyncio.create_subprocess_exec(sys.executable, *argv, stdout=asyncio.subprocess.PIPE, env=env)


async def serves(base_url: str, model: str) -> bool:
    """One streamed completion through the router succeeds."""
    import openai  # here, not at the top: this module is imported by the operator's conftest, and the openai SDK
    # takes over a second of CPU to import in every pure test session that never calls this

    async with openai.AsyncOpenAI(base_url=base_url, api_key="unused", max_retries=0, timeout=30) as sdk:
        try:
            stream = await sdk.chat.completions.create(
                model=model, messages=[{"role": "user", "content": "hi"}], max_tokens=4, stream=True
            )
            async for _ in stream:
                pass
        except openai.OpenAIError:
            return False
    return True


async def load_result(load: asyncio.subprocess.Process, within: float) -> dict[str, Any]:
    """The load client's JSON line: ok, cut_mid_stream, failed_before_first_byte."""
    async with asyncio.timeout(within):
        out, _ = await load.communicate()
    result: dict[str, Any] = json.loads(out.decode().strip().splitlines()[-1])
    return result


async def pdc_status(api: client.ApiClient, namespace: str, name: str) -> dict[str, Any]:
    obj = await client.CustomObjectsApi(api).get_namespaced_custom_object(GROUP, VERSION, namespace, "pdclusters", name)
    status: dict[str, Any] = obj.get("status") or {}
    return status


async def pods(api: client.ApiClient, namespace: str, selector: str = "tandem.dev/cluster") -> list[client.V1Pod]:
    listing = await client.CoreV1Api(api).list_namespaced_pod(namespace, label_selector=selector)
    return [p for p in listing.items if p.metadata.deletion_timestamp is None]


class Registry:
    """Reads the endpoint registry in the test etcd."""

    def __init__(self, endpoint: str) -> None:
        self.client = etcd_client([endpoint])

    async def __aenter__(self) -> Registry:
        await self.client.connect()
        return self

    async def __aexit__(self, *_: object) -> None:
        await self.client.close()

    async def endpoints(self, namespace: str, cluster: str) -> dict[str, Endpoint]:
        kvs = await self.client.get_prefix(registry.cluster_prefix(namespace, cluster).encode())
        found = {}
        for kv in kvs:
            endpoint = registry.decode(kv.value)
            found[endpoint.group] = endpoint
        return found

    async def leases(self, namespace: str, cluster: str) -> set[int]:
        kvs = await self.client.get_prefix(registry.cluster_prefix(namespace, cluster).encode())
        return {kv.lease for kv in kvs}


async def ready(api: client.ApiClient, namespace: str, name: str, prefill: int, decode: int) -> bool:
    status = await pdc_status(api, namespace, name)
    return (
        status.get("phase") == "Ready"
        and (status.get("prefill") or {}).get("readyGroups") == prefill
        and (status.get("decode") or {}).get("readyGroups") == decode
    )
