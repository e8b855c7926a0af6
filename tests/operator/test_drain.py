"""Drain before delete: the in-flight gauges, the verdict, the executor's wait, and the preStop hook for real."""

from __future__ import annotations

import asyncio
import sys
import time
from collections.abc import Awaitable, Callable
from pathlib import Path

import aiohttp
import pytest
from aiohttp import web

from tandem.registry import Role
from tandem_dev.sim.testing import start_worker
from tandem_operator.act.executor import Executor
from tandem_operator.decide.drain import SETTLE_S, DrainVerdict, drain_verdict, in_flight
from tandem_operator.decide.observe import GroupKey, GroupState, GroupView
from tandem_operator.decide.planner import DeleteGroup, DeletePods, DeleteReason, Observed, steps
from tandem_operator.decide.state import ClusterState
from tandem_operator.desired.drain_hook import prestop_command
from tandem_operator.desired.pods import RoleContext, group_pod
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
    assert command[3:5] == [  # the leader's, for every rank
        "http://kimi-decode-0.serving.svc:30001/ready",
        "http://kimi-decode-0.serving.svc:30001/metrics",
    ]
    assert command[5] == "600"
    assert pod["spec"]["terminationGracePeriodSeconds"] == 600 + 30


def _hook(leader_url: str, timeout_s: int = 30) -> list[str]:
    """The pods' preStop command, run with this interpreter and a faster poll than the pods' 2 s."""
    command = prestop_command(leader_url, timeout_s)
    command[-1] = "0.2"
    return [sys.executable, *command[1:]]


@pytest.mark.procs
async def test_prestop_hook_returns_once_nothing_is_in_flight_or_the_leader_is_not_ready() -> None:
    state = {"count": 2, "ready": 200}

    async def metrics(_: web.Request) -> web.Response:
        text = f'sglang:num_running_reqs{{model_name="m"}} {state["count"]}.0\n'
        return web.Response(text=text)

    async def ready(_: web.Request) -> web.Response:
        return web.Response(status=state["ready"])

    app = web.Application()
    app.router.add_get("/metrics", metrics)
    app.router.add_get("/ready", ready)
    runner = web.AppRunner(app)
    await runner.setup()
    site = web.TCPSite(runner, "127.0.0.1", 0)
    await site.start()
    port = site._server.sockets[0].getsockname()[1]  # type: ignore[union-attr]
    try:
        for release in ("count", "ready"):  # drained, or SGLang says it is not ready (a failed health check)
            state.update(count=2, ready=200)
            start = time.monotonic()
            hook = await asyncio.create_subprocess_exec(*_hook(f"http://127.0.0.1:{port}"))
            await asyncio.sleep(1.0)
            assert hook.returncode is None  # still waiting: 2 requests running, the leader ready
            state.update({release: 0 if release == "count" else 503})
            assert await asyncio.wait_for(hook.wait(), 10) == 0
            assert time.monotonic() - start < 10
    finally:
        await runner.cleanup()


async def _wait_for(check: Callable[[], Awaitable[bool]], within: float = 30.0) -> None:
    async with asyncio.timeout(within):
        while True:
            if await check():
                return
            await asyncio.sleep(0.1)


async def _get(sess: aiohttp.ClientSession, url: str) -> tuple[int, str]:
    async with sess.get(url) as resp:
        return resp.status, await resp.text()


def _running(metrics: str) -> int:
    return in_flight(metrics) or 0


@pytest.mark.procs
async def test_prestop_hook_gives_up_on_a_hung_worker_and_waits_for_a_busy_one(tmp_path: Path) -> None:
    """The real hook against ``tandem sim`` workers with a request in flight (25 ms a token, 2000 tokens: 50 s).
    A hung one (``/tandem/sim/faults {"hang": true}``: its scheduler stops, its ``/metrics`` still counts the stuck
    request) fails its liveness check (``/health_generate``, ``SGLANG_HEALTH_CHECK_TIMEOUT=2``), as before the
    kubelet runs the hook: the hook returns at its first poll. On a healthy busy one it waits for the drain."""
    extra = ["--enable-metrics", "--sim-inter-token-ms", "25"]
    env = {"SGLANG_HEALTH_CHECK_TIMEOUT": "2"}
    hung, busy = (start_worker(name, tmp_path, extra, env=env) for name in ("hung", "busy"))
    body = {"text": "a long story", "sampling_params": {"max_new_tokens": 2000, "ignore_eos": True}}
    try:
        async with aiohttp.ClientSession() as sess:
            loads = [asyncio.ensure_future(sess.post(f"{w.url}/generate", json=body)) for w in (hung, busy)]
            for w in (hung, busy):

                async def started(url: str = w.url) -> bool:
                    return _running((await _get(sess, f"{url}/metrics"))[1]) >= 1

                await _wait_for(started)  # a request in flight
            async with sess.post(f"{hung.url}/tandem/sim/faults", json={"hang": True}) as resp:
                assert resp.status == 200
            before = time.monotonic()
            assert (await _get(sess, f"{hung.url}/health_generate"))[0] == 503  # the liveness probe's check
            assert time.monotonic() - before >= 1.9  # SGLang's timeout, not at once
            status, text = await _get(sess, f"{hung.url}/metrics")
            assert status == 200
            assert _running(text) >= 1  # the stuck request still shows
            assert (await _get(sess, f"{hung.url}/ready"))[0] == 503
            start = time.monotonic()
            hook = await asyncio.create_subprocess_exec(*_hook(hung.url, timeout_s=600))
            assert await asyncio.wait_for(hook.wait(), 30) == 0
            assert time.monotonic() - start < 5  # not the drain timeout

            assert (await _get(sess, f"{busy.url}/health_generate"))[0] == 200  # busy, not hung
            assert (await _get(sess, f"{busy.url}/ready"))[0] == 200
            hook = await asyncio.create_subprocess_exec(*_hook(busy.url, timeout_s=600))
            await asyncio.sleep(1.0)
            assert not loads[1].done()  # the request is still running ...
            assert hook.returncode is None  # ... and the hook waits for it
            async with sess.post(f"{busy.url}/abort_request", json={"abort_all": True}) as resp:
                assert resp.status == 200  # the drain ends: nothing in flight
            assert await asyncio.wait_for(hook.wait(), 10) == 0
            for load in loads:
                load.cancel()
    finally:
        hung.proc.stop()
        busy.proc.stop()
