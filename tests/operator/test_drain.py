"""Drain before delete: the in-flight gauges, the verdict, the executor's wait, and the preStop hook for real."""

from __future__ import annotations

import asyncio
import sys
import time

import pytest
from aiohttp import web

from tandem.registry import Role
from tandem_operator.desired.drain_hook import prestop_command
from tandem_operator.desired.pods import RoleContext, group_pod
from tandem_operator.drain import SETTLE_S, DrainVerdict, drain_verdict, in_flight
from tandem_operator.executor import Executor
from tandem_operator.observe import GroupKey, GroupState, GroupView
from tandem_operator.planner import DeleteGroup, DeletePods, DeleteReason, Observed, steps
from tandem_operator.state import ClusterState
from tests.operator.conftest import kimi_spec
from tests.operator.fakes import FakeKube, FakeRegistrar
from tests.operator.workers import CLUSTER, POOL, live_pod

SPEC = kimi_spec()
CTX = RoleContext.build(CLUSTER, SPEC, Role.DECODE, POOL)

METRICS = """# HELP sglang:num_running_reqs The number of running requests.
# TYPE sglang:num_running_reqs gauge
sglang:num_running_reqs{model_name="kimi",tp_rank="0"} 3.0
sglang:num_running_reqs{model_name="kimi",tp_rank="1"} 1.0
# TYPE sglang:num_decode_transfer_queue_reqs gauge
sglang:num_decode_transfer_queue_reqs{model_name="kimi"} 2.0
# TYPE sglang:gen_throughput gauge
sglang:gen_throughput{model_name="kimi"} 99.0
"""


def test_in_flight_sums_the_drain_gauges_only() -> None:
    assert in_flight(METRICS) == 6
    assert in_flight(METRICS.replace("3.0", "0.0").replace("1.0", "0.0").replace("2.0", "0.0")) == 0
    assert in_flight("# nothing here\n") is None


@pytest.mark.parametrize(
    ("elapsed", "count", "verdict"),
    [
        (0.5, 0, DrainVerdict.WAIT),  # routers may still be sending what they routed before the delete
        (SETTLE_S + 1, 0, DrainVerdict.DRAINED),
        (SETTLE_S + 1, 4, DrainVerdict.WAIT),
        (SETTLE_S + 1, None, DrainVerdict.WAIT),  # no answer: not known to be idle
        (600, 4, DrainVerdict.TIMED_OUT),
        (600, None, DrainVerdict.TIMED_OUT),
    ],
)
def test_drain_verdict(elapsed: float, count: int | None, verdict: DrainVerdict) -> None:
    assert drain_verdict(elapsed, count, timeout_s=600) is verdict


def _scale_down_step() -> DeletePods:
    pods = {p["metadata"]["name"]: p for p in (live_pod(SPEC, Role.DECODE, 1, r) for r in range(2))}
    view = GroupView(1, GroupState.READY, CTX.template_hash, tuple(sorted(pods)))
    seen = Observed(pods, {}, {}, frozenset())
    (step,) = steps(CTX, [DeleteGroup(1, DeleteReason.SCALE_DOWN)], {1: view}, seen)
    assert isinstance(step, DeletePods)
    return step


def test_a_serving_group_is_drained_a_broken_one_is_not() -> None:
    step = _scale_down_step()
    assert step.drain is not None
    assert step.drain.metrics_url == "http://10.0.0.1:30001/metrics"  # the leader's pod IP and HTTP port
    assert step.drain.timeout_s == 600
    broken = GroupView(1, GroupState.BROKEN, CTX.template_hash, ())
    (delete,) = steps(CTX, [DeleteGroup(1, DeleteReason.BROKEN)], {1: broken}, Observed({}, {}, {}, frozenset()))
    assert isinstance(delete, DeletePods)
    assert delete.drain is None


async def test_executor_unregisters_then_waits_for_zero_in_flight_before_deleting_pods() -> None:
    kube, registrar = FakeKube(), FakeRegistrar()
    state = ClusterState(CLUSTER, SPEC)
    executor = Executor(state, kube, registrar, "test")
    readings = [5, 5, 0]

    async def in_flight_now(url: str) -> int | None:
        return readings.pop(0)

    executor.worker_metrics.in_flight = in_flight_now  # type: ignore[method-assign]
    step = _scale_down_step()
    key = GroupKey(Role.DECODE, 1)
    assert await executor.delete(step) is False  # unregistered, settling
    assert ("unregister", "decode-1", None) in registrar.log
    assert key in state.retiring
    assert kube.verbs("delete") == []
    state.draining[key] -= SETTLE_S + 1  # the settle time has passed
    assert await executor.delete(step) is False  # 5 requests still in flight
    assert kube.verbs("delete") == []
    assert await executor.delete(step) is True  # drained: now the Service and pods go
    assert [c[1].split("/")[-2] for c in kube.verbs("delete")] == ["services", "poddisruptionbudgets", "pods", "pods"]
    assert key not in state.draining
    await executor.close()


def test_pods_wait_for_the_drain_on_prestop_and_the_grace_period_covers_it() -> None:
    pod = group_pod(CTX, 0, 1)
    command = pod["spec"]["containers"][0]["lifecycle"]["preStop"]["exec"]["command"]
    assert command[3] == "http://kimi-decode-0.serving.svc:30001/metrics"  # the leader's, for every rank
    assert command[4] == "600"
    assert pod["spec"]["terminationGracePeriodSeconds"] == 600 + 30


@pytest.mark.procs
async def test_prestop_hook_returns_once_nothing_is_in_flight() -> None:
    busy = {"count": 2}

    async def metrics(_: web.Request) -> web.Response:
        text = f'sglang:num_running_reqs{{model_name="m"}} {busy["count"]}.0\n'
        return web.Response(text=text)

    app = web.Application()
    app.router.add_get("/metrics", metrics)
    runner = web.AppRunner(app)
    await runner.setup()
    site = web.TCPSite(runner, "127.0.0.1", 0)
    await site.start()
    port = site._server.sockets[0].getsockname()[1]  # type: ignore[union-attr]
    try:
        command = prestop_command(f"http://127.0.0.1:{port}/metrics", 30)
        command[-1] = "0.2"  # poll faster than the pods' 2 s
        start = time.monotonic()
        hook = await asyncio.create_subprocess_exec(sys.executable, *command[1:])
        await asyncio.sleep(1.0)
        assert hook.returncode is None  # still waiting: 2 requests running
        busy["count"] = 0
        assert await asyncio.wait_for(hook.wait(), 10) == 0
        assert time.monotonic() - start < 10
    finally:
        await runner.cleanup()
