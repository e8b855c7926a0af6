"""The operator's HTTP endpoint (``--metrics-port``): ``/healthz`` for the chart's probes and ``/metrics``.

It is served from process start, before leader election, so a standby replica is Ready (it is healthy, just not
leading) and is not restarted by its liveness probe while it waits.
"""

from __future__ import annotations

from aiohttp import web
from prometheus_client import CONTENT_TYPE_LATEST, CollectorRegistry, Counter, Gauge, Histogram, generate_latest

from tandem_operator.decide.fencing import FenceReason

REGISTRY = CollectorRegistry()
FENCES = Counter("tandem_operator_fences", "Groups fenced", ["reason"], registry=REGISTRY)
# Every reason exported at 0 from the start: a first fence is then an increase (1 - 0) that rate()/increase()
# and the fencing alert see, instead of a new series whose first sample is already 1.
for _reason in FenceReason:
    FENCES.labels(_reason.value)
FENCE_SECONDS = Histogram(
    "tandem_operator_fence_seconds",
    "From a pod event to its group's registry key deleted",
    buckets=(0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1, 2.5),
    registry=REGISTRY,
)
RECOVERY_SECONDS = Histogram(
    "tandem_operator_recovery_seconds",
    "From a member's death to its group registered again",
    buckets=(1, 2, 5, 10, 30, 60, 120, 300, 600, 1800),
    registry=REGISTRY,
)
KUBE_REQUESTS = Counter(
    "tandem_operator_kube_requests",
    "Kubernetes API requests sent by the reconcile and fence paths",
    ["method"],
    registry=REGISTRY,
)
LEADER = Gauge("tandem_operator_leader", "1 while this replica holds the leader Lease", registry=REGISTRY)


async def _healthz(_: web.Request) -> web.Response:
    return web.Response(text="ok")


async def _metrics(_: web.Request) -> web.Response:
    return web.Response(body=generate_latest(REGISTRY), headers={"Content-Type": CONTENT_TYPE_LATEST})


async def serve(host: str, port: int) -> web.AppRunner:
    app = web.Application()
    app.router.add_get("/healthz", _healthz)
    app.router.add_get("/metrics", _metrics)
    runner = web.AppRunner(app, access_log=None)
    await runner.setup()
    await web.TCPSite(runner, host, port).start()
    return runner
