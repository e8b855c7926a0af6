"""``tandem bench operator``: the operator at fleet scale on the real control plane.

For each point of the scaling curve (``TANDEM_BENCH_OPERATOR_GROUPS``, default 100,250,500 groups; ``--quick``:
10): a fresh dev cluster (kube-apiserver, controller-manager, scheduler, etcd) with 4 kwok GPU nodes per group,
the registry in its own etcd, one ``tandem operator`` process, and one PDCluster of N groups of 4 nodes (half
prefill, half decode). Measured: time from the create to every group Ready and to every group registered, the
operator's peak RSS (``VmHWM``), CPU time and Kubernetes API requests, fences during the ramp
(``bench_ramp``); then one member pod of a decode group is deleted and the time to its group's registry key
deleted (fence), to the group re-registered with epoch + 1 and to the cluster Ready again (recover) is taken from
an etcd watch on that key.

The pods' image is not an SGLang one, so the dev cluster's pod runner would start nothing for them (and none
runs here): 400 simulated workers would swamp two cores. So the cluster runs with ``kwok_marks_ready``: kwok marks
every bound pod Running and Ready without its readinessProbe, and that readiness is what the operator's gang
status, registry and fencing act on.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import os
import shutil
import sys
import tempfile
import time
from collections import Counter
from collections.abc import Awaitable, Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from kubernetes_asyncio import client
from kubernetes_asyncio import config as kube_config

from tandem import registry
from tandem.registry_etcd import client as etcd_client
from tandem_dev.bench import BenchArgs, Table
from tandem_dev.devcluster.cluster import DevCluster
from tandem_dev.devcluster.config import DevClusterConfig
from tandem_dev.operator import bench_apiserver
from tandem_dev.operator.bench_ramp import (
    CurvePoint,
    RampFences,
    curve_tables,
    fence_during_ramp,
    kube_requests,
    load_average,
    percentile,
)
from tandem_dev.procs import ManagedProcess, free_port
from tandem_operator.api.common import GROUP, VERSION
from tandem_operator.crdgen import rendered_files

NAMESPACE = "bench"
CLUSTER = "fleet"
NODES_PER_GROUP = 4
NOOP_IMAGE = "tandem-bench/noop-worker:0"  # no "sglang" in it: the pod runner ignores such pods


@dataclass(frozen=True)
class Scale:
    nodes: int
    prefill_groups: int
    decode_groups: int

    @property
    def groups(self) -> int:
        return self.prefill_groups + self.decode_groups

    @classmethod
    def of(cls, groups: int) -> Scale:
        return cls(nodes=groups * NODES_PER_GROUP, prefill_groups=groups // 2, decode_groups=groups - groups // 2)


POINTS_ENV = "TANDEM_BENCH_OPERATOR_GROUPS"
CURVE = (100, 250, 500)
QUICK = (10,)
RAMP_FENCES, QUICK_RAMP_FENCES = 20, 3
POD_POLL_S = 2.0  # listing 1,000 pods is ~10 MB of JSON for the API server to write and this process to read


def points(quick: bool) -> tuple[int, ...]:
    """Group counts to measure: ``TANDEM_BENCH_OPERATOR_GROUPS`` (comma-separated), else the curve."""
    if quick:
        return QUICK
    raw = os.environ.get(POINTS_ENV, "")
    try:
        chosen = tuple(int(v) for v in raw.split(",") if v.strip())
    except ValueError:
        raise SystemExit(f"{POINTS_ENV}={raw!r}: expected comma-separated group counts, e.g. 100,250") from None
    if any(g < 2 for g in chosen):
        raise SystemExit(f"{POINTS_ENV}={raw!r}: every point needs at least 2 groups (a prefill and a decode)")
    return chosen or CURVE


def pdcluster(scale: Scale, etcd: str) -> dict[str, Any]:
    """Kimi-K2.6-shaped groups: 4 nodes x 8 GPUs, TP = EP = 32, DeepEP; each pod takes a whole node."""

    def role(groups: int) -> dict[str, Any]:
        return {"groups": groups, "nodesPerGroup": NODES_PER_GROUP, "gpusPerNode": 8, "tpSize": 32, "epSize": 32}

    return {
        "apiVersion": f"{GROUP}/{VERSION}",
        "kind": "PDCluster",
        "metadata": {"name": CLUSTER},
        "spec": {
            "model": {"path": "moonshotai/Kimi-K2.6", "servedName": "kimi-k2.6"},
            "images": {"worker": NOOP_IMAGE},
            "prefill": role(scale.prefill_groups),
            "decode": role(scale.decode_groups),
            "transfer": {"protocol": "tcp"},
            "etcd": {"endpoints": [etcd]},
        },
    }


@dataclass
class Measured:
    pods_created_s: float = 0.0
    pods_ready_s: float = 0.0
    ready_s: float = 0.0
    registered_s: float = 0.0
    rss_peak_mib: float = 0.0
    rss_now_mib: float = 0.0
    cpu_ramp_s: float = 0.0
    cluster_up_s: float = 0.0
    requests: int = 0
    load: float = 0.0
    ramp: RampFences = field(default_factory=RampFences)
    component_cpu_s: dict[str, float] = field(default_factory=dict)  # control-plane CPU, create -> all registered
    apiserver_requests: Counter[tuple[str, str]] = field(default_factory=Counter)  # (verb, resource), in the ramp
    events: Counter[tuple[str, str]] = field(default_factory=Counter)  # (reporting component, reason), in the ramp
    fenced_s: float = 0.0
    operator_fence_ms: float = 0.0
    reregistered_s: float = 0.0
    recovered_s: float = 0.0
    epochs: tuple[int, int] = (0, 0)


def run(args: BenchArgs) -> list[Table]:
    tables, curve = [], []
    for groups in points(args.quick):
        scale = Scale.of(groups)
        fences = QUICK_RAMP_FENCES if args.quick else RAMP_FENCES
        with tempfile.TemporaryDirectory(prefix="tandem-bench-operator-") as tmp:
            m = asyncio.run(_bench(Path(tmp), scale, fences))
        point = [_table(scale, m), *bench_apiserver.tables(f"{groups} groups", m.apiserver_requests, m.events)]
        tables += point
        for table in point:  # each point as it is measured (minutes each)
            print(table.render(), file=sys.stderr, flush=True)
        p99 = percentile(m.ramp.end_to_end_ms, 99)
        ready, registered, rss = m.ready_s, m.registered_s, m.rss_peak_mib
        curve.append(
            CurvePoint(
                groups,
                scale.nodes,
                m.cluster_up_s,
                ready,
                registered,
                rss,
                m.requests,
                p99,
                len(m.ramp.end_to_end_ms),
                m.load,
            )
        )
    return [*tables, *curve_tables(curve)]


def _table(scale: Scale, m: Measured) -> Table:
    pods = scale.groups * NODES_PER_GROUP
    title = f"operator: one PDCluster, {scale.groups} groups x {NODES_PER_GROUP} nodes on {scale.nodes} kwok GPU nodes"
    return Table(
        title,
        ["measurement", "value", "unit"],
        [
            [f"create -> all {pods} pods created by the operator", m.pods_created_s, "s"],
            [f"create -> all {pods} pods scheduled and Ready (kwok)", m.pods_ready_s, "s"],
            ["create -> every group Ready (PDCluster phase Ready)", m.ready_s, "s"],
            ["create -> every group registered in etcd", m.registered_s, "s"],
            ["operator peak RSS (VmHWM)", m.rss_peak_mib, "MiB"],
            ["operator RSS after the ramp (VmRSS)", m.rss_now_mib, "MiB"],
            ["operator CPU time, start -> all registered", m.cpu_ramp_s, "s"],
            ["operator Kubernetes API requests, start -> all registered", m.requests, "requests"],
            [
                f"fence during the ramp, pod delete -> key deleted, p50 (n={len(m.ramp.end_to_end_ms)})",
                percentile(m.ramp.end_to_end_ms, 50),
                "ms",
            ],
            ["fence during the ramp, pod delete -> key deleted, p99", percentile(m.ramp.end_to_end_ms, 99), "ms"],
            ["  pod delete -> seen by a watch (the benchmark's own), p99", percentile(m.ramp.watch_ms, 99), "ms"],
            ["  pod event -> key deleted (the operator's own timing), p99", percentile(m.ramp.operator_ms, 99), "ms"],
            ["pod delete -> group's registry key deleted (fence, etcd watch)", m.fenced_s * 1000, "ms"],
            ["  of which pod event -> key deleted (operator's own timing)", m.operator_fence_ms, "ms"],
            [f"pod delete -> group re-registered, epoch {m.epochs[0]} -> {m.epochs[1]}", m.reregistered_s, "s"],
            ["pod delete -> PDCluster Ready again", m.recovered_s, "s"],
        ],
        notes=[
            f"{pods} pods; the worker image is not SGLang's, so no simulated worker runs: kwok marks pods Ready and "
            "that readiness drives gang status, registry and fencing",
            "one kube-apiserver, controller-manager, scheduler, kwok and the operator share this machine's cores; "
            f"pod counts are polled every {POD_POLL_S:.0f} s",
            f"dev cluster with {scale.nodes} nodes up in {m.cluster_up_s:.0f} s; load average {m.load:.1f} at the "
            "end of the ramp",
            f"control-plane CPU seconds, create -> all registered: {m.component_cpu_s}",
        ],
    )


async def _bench(root: Path, scale: Scale, ramp_fences: int) -> Measured:
    cluster = DevCluster(root / "k8s", DevClusterConfig(nodes=scale.nodes, kwok_marks_ready=True))
    etcd = _registry_etcd(root)
    operator: ManagedProcess | None = None
    try:
        print(f"operator bench: starting a dev cluster with {scale.nodes} nodes", file=sys.stderr, flush=True)
        await asyncio.to_thread(cluster.start)
        url = await asyncio.to_thread(_await_etcd, etcd)
        await _install_crds(cluster, root)
        api = await kube_config.new_client_from_config(config_file=str(cluster.kubeconfig))
        try:
            await _namespace(api)
            metrics = free_port()
            operator = _operator(cluster, url, root, metrics).start()
            await asyncio.to_thread(operator.wait_http, f"http://127.0.0.1:{metrics}/healthz", 60)
            m = Measured(cluster_up_s=cluster.timings["total"])
            cpu = {p.name: _cpu_seconds(p.pid) for p in cluster.processes}
            await _measure(api, operator, url, scale, m, ramp_fences, f"http://127.0.0.1:{metrics}/metrics", cluster)
            m.component_cpu_s = {name: round(t - cpu.get(name, 0.0), 1) for name, t in m.component_cpu_s.items()}
            return m
        finally:
            await api.close()
    finally:
        if operator is not None:
            operator.stop()
        cluster.stop()
        etcd.stop()


async def _measure(
    api: client.ApiClient,
    operator: ManagedProcess,
    etcd: str,
    scale: Scale,
    m: Measured,
    fences: int,
    metrics: str,
    cluster: DevCluster,
) -> None:
    custom = client.CustomObjectsApi(api)
    requests_before, events_before = await bench_apiserver.apiserver_requests(api), await bench_apiserver.events(api)
    began = time.monotonic()
    await custom.create_namespaced_custom_object(GROUP, VERSION, NAMESPACE, "pdclusters", pdcluster(scale, etcd))
    reg = etcd_client([etcd])
    await reg.connect()
    try:
        prefix = registry.cluster_prefix(NAMESPACE, CLUSTER).encode()

        async def count_registered() -> int:
            return len(await reg.get_prefix(prefix))

        async def all_ready() -> bool:
            return await _ready(custom, scale)

        pods = asyncio.create_task(_watch_pods(api, scale.groups * NODES_PER_GROUP, began, m))
        ramp_over = asyncio.Event()
        step = max(1, scale.prefill_groups // fences)
        victims = [f"{CLUSTER}-prefill-{i}-1" for i in range(0, scale.prefill_groups, step)][:fences]
        fencer = asyncio.create_task(fence_during_ramp(api, NAMESPACE, victims, m.ramp, ramp_over))
        try:
            m.ready_s = await _until(all_ready, began, 900)
            await asyncio.wait_for(pods, 60)
        finally:
            ramp_over.set()
            pods.cancel()
        await fencer
        m.registered_s = await _until(lambda: _equals(count_registered, scale.groups), began, 300)
        m.cpu_ramp_s = _cpu_seconds(operator.pid)
        m.component_cpu_s = {p.name: _cpu_seconds(p.pid) for p in cluster.processes}
        m.rss_peak_mib, m.rss_now_mib = _memory_mib(operator.pid)
        m.requests, m.load = await kube_requests(metrics), load_average()
        m.apiserver_requests = await bench_apiserver.apiserver_requests(api) - requests_before
        m.events = await bench_apiserver.events(api) - events_before
        m.ramp.read_log(operator.log_path)
        await _fence_and_recover(api, custom, reg, scale, m, operator)
    finally:
        await reg.close()


async def _fence_and_recover(
    api: client.ApiClient, custom: client.CustomObjectsApi, reg: Any, scale: Scale, m: Measured, op: ManagedProcess
) -> None:
    key = f"{registry.cluster_prefix(NAMESPACE, CLUSTER)}decode/decode-0".encode()
    current = await reg.get(key)
    before = registry.decode(current.value).epoch
    watch = await reg.watch(key, start_revision=current.header.revision + 1)
    deleted_at: float | None = None
    started = time.monotonic()
    try:
        await client.CoreV1Api(api).delete_namespaced_pod(f"{CLUSTER}-decode-0-1", NAMESPACE)
        async with asyncio.timeout(300):
            async for event in watch:
                now = time.monotonic()
                if event.kind == "DELETE" and deleted_at is None:
                    deleted_at = now
                elif event.kind == "PUT" and deleted_at is not None:
                    after = registry.decode(event.kv.value).epoch
                    if after > before:
                        m.reregistered_s, m.epochs = now - started, (before, after)
                        break
    finally:
        await watch.cancel()
    if deleted_at is None:
        raise RuntimeError("the deleted pod's group was never fenced")
    m.fenced_s = deleted_at - started

    async def all_ready() -> bool:
        return await _ready(custom, scale)

    m.recovered_s = await _until(all_ready, started, 300)
    m.operator_fence_ms = _logged_fence_ms(op.log_path)


async def _watch_pods(api: client.ApiClient, n: int, began: float, m: Measured) -> None:
    """Record when all ``n`` pods exist and when all are Ready (raw JSON: 1,000 pod models are slow to build; from
    the API server's watch cache, ``resource_version="0"``)."""
    core = client.CoreV1Api(api)
    while not m.pods_ready_s:
        response: Any = await core.list_namespaced_pod(NAMESPACE, resource_version="0", _preload_content=False)
        items = json.loads(await response.read())["items"]
        now = time.monotonic() - began
        if len(items) >= n and not m.pods_created_s:
            m.pods_created_s = now
        ready = sum(
            any(c["type"] == "Ready" and c["status"] == "True" for c in (p.get("status") or {}).get("conditions") or [])
            for p in items
        )
        if ready >= n:
            m.pods_ready_s = now
            return
        await asyncio.sleep(POD_POLL_S)


async def _ready(custom: client.CustomObjectsApi, scale: Scale) -> bool:
    obj = await custom.get_namespaced_custom_object(GROUP, VERSION, NAMESPACE, "pdclusters", CLUSTER)
    status = obj.get("status") or {}
    return (
        status.get("phase") == "Ready"
        and (status.get("prefill") or {}).get("readyGroups") == scale.prefill_groups
        and (status.get("decode") or {}).get("readyGroups") == scale.decode_groups
    )


async def _equals(count: Callable[[], Awaitable[int]], n: int) -> bool:
    return await count() == n


async def _until(check: Callable[[], Awaitable[bool]], began: float, within: float) -> float:
    """Seconds from ``began`` until ``check`` holds (polled every 100 ms)."""
    async with asyncio.timeout(within):
        while True:
            if await check():
                return time.monotonic() - began
            await asyncio.sleep(0.1)


def _memory_mib(pid: int) -> tuple[float, float]:
    fields = dict(line.split(":", 1) for line in Path(f"/proc/{pid}/status").read_text().splitlines() if ":" in line)
    return int(fields["VmHWM"].split()[0]) / 1024, int(fields["VmRSS"].split()[0]) / 1024


def _cpu_seconds(pid: int) -> float:
    stat = Path(f"/proc/{pid}/stat").read_text().rpartition(")")[2].split()
    return (int(stat[11]) + int(stat[12])) / os.sysconf("SC_CLK_TCK")  # utime + stime


def _logged_fence_ms(log: Path) -> float:
    for line in reversed(log.read_text(errors="replace").splitlines()):
        with contextlib.suppress(ValueError):
            record = json.loads(line)
            if record.get("msg") == "group fenced":
                return float(record["fenced_ms"])
    return float("nan")


def _registry_etcd(root: Path) -> ManagedProcess:
    binary = shutil.which("etcd") or "/usr/bin/etcd"
    client_port, peer = free_port(), free_port()
    url = f"http://127.0.0.1:{client_port}"
    argv = [binary, "--data-dir", str(root / "registry-etcd"), "--listen-client-urls", url]
    argv += ["--advertise-client-urls", url, "--listen-peer-urls", f"http://127.0.0.1:{peer}"]
    argv += ["--initial-advertise-peer-urls", f"http://127.0.0.1:{peer}"]
    argv += ["--initial-cluster", f"default=http://127.0.0.1:{peer}"]
    return ManagedProcess("registry-etcd", argv, root / "registry-etcd.log").start()


def _await_etcd(proc: ManagedProcess) -> str:
    url = next(a for a in proc.argv if a.startswith("http://"))
    proc.wait_http(f"{url}/health", timeout=30)
    return url


async def _install_crds(cluster: DevCluster, root: Path) -> None:
    crds = root / "crds"
    crds.mkdir()
    for name, text in rendered_files().items():
        (crds / name).write_text(text)
    await _kubectl(cluster, "apply", "--server-side", "-f", str(crds))
    await asyncio.to_thread(cluster.wait_established, [path.stem for path in crds.glob("*.yaml")])


async def _kubectl(cluster: DevCluster, *argv: str) -> None:
    proc = await asyncio.create_subprocess_exec(
        str(cluster.tool("kubectl")),
        *argv,
        env={**os.environ, **cluster.env()},
        stdout=asyncio.subprocess.PIPE,
        stderr=asyncio.subprocess.STDOUT,
    )
    async with asyncio.timeout(90):
        out, _ = await proc.communicate()
    if proc.returncode != 0:
        raise RuntimeError(f"kubectl {' '.join(argv)} failed: {out.decode()}")


async def _namespace(api: client.ApiClient) -> None:
    core = client.CoreV1Api(api)
    await core.create_namespace(client.V1Namespace(metadata=client.V1ObjectMeta(name=NAMESPACE)))

    async def has_default_account() -> bool:  # the controller-manager creates it; pods need it
        accounts = await core.list_namespaced_service_account(NAMESPACE)
        return any(sa.metadata.name == "default" for sa in accounts.items)

    await _until(has_default_account, time.monotonic(), 60)


def _operator(cluster: DevCluster, etcd: str, root: Path, metrics_port: int) -> ManagedProcess:
    argv = [sys.executable, "-m", "tandem.cli", "operator", "--kubeconfig", str(cluster.kubeconfig)]
    argv += ["--metrics-port", str(metrics_port), "--metrics-host", "127.0.0.1"]
    argv += ["--namespace", NAMESPACE, "--etcd-endpoints", etcd, "--no-leader-election", "--identity", "bench"]
    return ManagedProcess("operator", argv, root / "operator.log")
