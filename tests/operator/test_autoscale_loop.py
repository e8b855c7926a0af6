"""The autoscaler's adapter: it scrapes a router and the registered leaders over HTTP, writes the pool's scale
subresource and reports the decision in status (a fake Kube records the writes)."""

from __future__ import annotations

from collections.abc import AsyncIterator
from typing import Any

import pytest
from aiohttp import web
from prometheus_client import CollectorRegistry, Gauge, Histogram, generate_latest

from tandem.registry import Endpoint, Role
from tandem_dev.procs import free_port
from tandem_operator.act.worker_metrics import WorkerMetrics
from tandem_operator.api.pdcluster import PDClusterSpec
from tandem_operator.autoscale.decide import Reason
from tandem_operator.autoscale.loop import Autoscaler
from tandem_operator.decide.observe import GroupKey
from tandem_operator.decide.state import ClusterState
from tandem_operator.desired.naming import ClusterRef
from tests.operator.fakes import FakeKube

pytestmark = pytest.mark.timeout(30)
POOLS = "/apis/tandem.dev/v1alpha1/namespaces/ns/pdpools"


class Exposition:
    """What the fake router and leaders answer on /metrics."""

    def __init__(self) -> None:
        self.router = CollectorRegistry()
        self.itl = Histogram("tandem_router_inter_token_seconds", "", buckets=(0.01, 0.05, 0.1), registry=self.router)
        self.ttft = Histogram("tandem_router_ttft_seconds", "", buckets=(0.1, 1.0, 5.0), registry=self.router)
        self.ttft.observe(0.05)
        self.worker = CollectorRegistry()
        self.gauges = {
            name: Gauge(f"sglang:{name}", "", registry=self.worker)
            for name in ("num_queue_reqs", "token_usage", "num_running_reqs", "gen_throughput")
        }
        for name, gauge in self.gauges.items():
            gauge.set(0.2 if name == "token_usage" else 1)

    async def serve(self, request: web.Request) -> web.Response:
        registry = self.router if request.path == "/router/metrics" else self.worker
        return web.Response(body=generate_latest(registry), content_type="text/plain")


@pytest.fixture
async def exposition() -> AsyncIterator[tuple[Exposition, str]]:
    exp = Exposition()
    app = web.Application()
    app.router.add_get("/{tail:.*}", exp.serve)
    runner = web.AppRunner(app)
    await runner.setup()
    port = free_port()
    await web.TCPSite(runner, "127.0.0.1", port).start()
    yield exp, f"http://127.0.0.1:{port}"
    await runner.cleanup()


def cluster(routers: dict[str, Any]) -> PDClusterSpec:
    autoscaling = {"targets": {"ttftP90Ms": 1000, "itlP90Ms": 50}, "scaleUpStabilizationSeconds": 0, **routers}
    return PDClusterSpec.model_validate(
        {"transfer": {"protocol": "tcp"}, "etcd": {"endpoints": ["http://127.0.0.1:2379"]}, "autoscaling": autoscaling}
    )


def router_pod(ip: str, ready: bool, deleting: bool = False) -> dict[str, Any]:
    meta: dict[str, Any] = {"name": f"router-{ip}-{ready}-{deleting}"}
    if deleting:
        meta["deletionTimestamp"] = "2026-01-01T00:00:00Z"
    status = {"podIP": ip, "conditions": [{"type": "Ready", "status": str(ready)}]}
    return {"apiVersion": "v1", "kind": "Pod", "metadata": meta, "status": status}


async def test_router_pods_by_selector_ready_and_not_deleting() -> None:
    spec = cluster({"routerSelector": {"app.kubernetes.io/component": "router"}, "routerPort": 8123}).autoscaling
    assert spec is not None
    kube = FakeKube()
    for n, pod in enumerate(
        [router_pod("10.0.0.1", True), router_pod("10.0.0.2", False), router_pod("10.0.0.3", True, deleting=True)]
    ):
        kube.objects[str(n)] = pod
    autoscaler = Autoscaler(
        ClusterState(ClusterRef("sim", "ns", "uid"), cluster({"routerMetrics": ["x"]})), kube, WorkerMetrics()
    )
    assert await autoscaler.router_urls(spec) == ["http://10.0.0.1:8123/metrics"]


async def test_a_slow_decode_is_scaled_through_the_scale_subresource(exposition: tuple[Exposition, str]) -> None:
    exp, base = exposition
    spec = cluster({"routerMetrics": [f"{base}/router/metrics"]})
    state = ClusterState(ClusterRef("sim", "ns", "uid"), spec)
    for role in Role:
        key = GroupKey(role, 0)
        state.registered[key] = Endpoint(role=role, group=f"{role.value}-0", url=base, model="m")
    kube = FakeKube()
    for role in Role:
        kube.objects[f"{POOLS}/sim-{role.value}"] = {"spec": {"replicas": 1}, "status": {"readyReplicas": 1}}
    workers = WorkerMetrics()
    autoscaler = Autoscaler(state, kube, workers)
    assert spec.autoscaling is not None
    try:
        first = await autoscaler.tick(spec.autoscaling)  # the first scrape is the baseline: no interval yet
        assert first.verdicts[Role.DECODE].reason is Reason.METRICS_MISSING
        for _ in range(20):
            exp.itl.observe(0.09)  # ITL p90 ~90 ms against 50
        second = await autoscaler.tick(spec.autoscaling)
    finally:
        await workers.close()
    assert second.verdicts[Role.DECODE].reason is Reason.SCALE_UP
    assert ("patch", f"{POOLS}/sim-decode/scale", {"spec": {"replicas": 2}}) in kube.calls
    assert not [c for c in kube.calls if c[1] == f"{POOLS}/sim-prefill/scale"]
    status = [c[2] for c in kube.verbs("patch") if c[1].endswith("/pdclusters/sim/status")][-1]
    decided = status["status"]["autoscaling"]
    assert decided["decode"]["desiredGroups"] == 2
    assert decided["decode"]["reason"] == "ScaleUp"
    assert decided["itlP90Ms"] > 50


async def test_requests_held_in_the_routers_queues_scale_the_decodes(exposition: tuple[Exposition, str]) -> None:
    """Flow control holds requests back in the router while the workers' gauges look calm (none queued, KV 0.2):
    the held-back demand alone, with TTFT over target, scales decode."""
    exp, base = exposition
    exp.gauges["num_queue_reqs"].set(0)
    spec = cluster({"routerMetrics": [f"{base}/router/metrics"]})
    state = ClusterState(ClusterRef("sim", "ns", "uid"), spec)
    for role in Role:
        state.registered[GroupKey(role, 0)] = Endpoint(role=role, group=f"{role.value}-0", url=base, model="m")
    kube = FakeKube()
    for role in Role:
        kube.objects[f"{POOLS}/sim-{role.value}"] = {"spec": {"replicas": 1}, "status": {"readyReplicas": 1}}
    held = Gauge("tandem_router_flow_queued_requests", "", ["priority"], registry=exp.router)
    workers = WorkerMetrics()
    autoscaler = Autoscaler(state, kube, workers)
    assert spec.autoscaling is not None
    try:
        await autoscaler.tick(spec.autoscaling)  # the baseline
        calm = await autoscaler.tick(spec.autoscaling)
        assert calm.verdicts[Role.DECODE].reason is not Reason.SCALE_UP
        held.labels("0").set(6)
        held.labels("10").set(2)
        for _ in range(20):
            exp.ttft.observe(3.0)  # TTFT p90 ~3 s against 1 s
        third = await autoscaler.tick(spec.autoscaling)
    finally:
        await workers.close()
    verdict = third.verdicts[Role.DECODE]
    assert verdict.reason is Reason.SCALE_UP, verdict.message
    assert "8 held back in the routers' queues (6 at priority 0, 2 at priority 10)" in verdict.message
    assert ("patch", f"{POOLS}/sim-decode/scale", {"spec": {"replicas": 2}}) in kube.calls
