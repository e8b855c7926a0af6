"""What the pod runner does in a kubelet's place, without the control plane: readiness probes as the pod spec
states them (tandem_dev/devcluster/probes.py) and the status it reports (tandem_dev/devcluster/podstatus.py)."""

from __future__ import annotations

from collections.abc import AsyncIterator, Sequence
from typing import Any

import aiohttp
import pytest
from aiohttp import web

from tandem_dev.devcluster.podstatus import ContainerView, Terminated, backoff_s, restarts, status_patch
from tandem_dev.devcluster.probes import (
    LIVENESS,
    READINESS,
    STARTUP,
    ContainerProbes,
    Probe,
    ProbeSpecError,
    ProbeTarget,
    ProbeTiming,
    ProbeTracker,
    Verdict,
    check,
    kill_grace_s,
    prestop_command,
)
from tandem_dev.procs import free_port

pytestmark = pytest.mark.timeout(30)
CONTAINER: dict[str, Any] = {
    "name": "sglang",
    "ports": [{"name": "http", "containerPort": 30001}],
    "readinessProbe": {"httpGet": {"path": "/health", "port": "http"}, "periodSeconds": 5, "failureThreshold": 3},
}


def test_probe_parse_resolves_named_ports_and_applies_the_api_defaults() -> None:
    probe = Probe.parse(CONTAINER)
    assert probe == Probe("httpGet", port=30001, path="/health", timing=ProbeTiming(period_s=5.0))
    assert (probe.timing.timeout_s, probe.timing.success_threshold, probe.timing.failure_threshold) == (1.0, 1, 3)
    assert Probe.parse({"name": "c"}) is None
    tcp = Probe.parse({"readinessProbe": {"tcpSocket": {"port": 8998}, "initialDelaySeconds": 3}})
    assert tcp == Probe("tcpSocket", port=8998, timing=ProbeTiming(initial_delay_s=3.0))
    with pytest.raises(ProbeSpecError, match="probe port 'metrics' is not a port of container 'sglang'"):
        Probe.parse({**CONTAINER, "readinessProbe": {"httpGet": {"port": "metrics"}}})


def test_readiness_needs_success_threshold_successes_and_goes_after_failure_threshold_failures() -> None:
    tracker = ProbeTracker(Probe("tcpSocket", port=1, timing=ProbeTiming(success_threshold=2, failure_threshold=3)))
    assert [tracker.record(ok) for ok in (True, False, True, True)] == [False, False, False, True]
    assert tracker.ready
    assert [tracker.record(ok) for ok in (False, False, True, False, False, False)] == [False] * 5 + [True]
    assert not tracker.ready


def test_a_probe_still_running_is_not_started_again_and_reruns_at_once_after_its_period() -> None:
    health = {"httpGet": {"path": "/health", "port": 30001}}
    probes = ContainerProbes.for_container(
        {"readinessProbe": {**health, "periodSeconds": 5}, "livenessProbe": {**health, "periodSeconds": 10}}, 0.0
    )
    assert probes.due(0.0) == [READINESS, LIVENESS]
    assert probes.due(5.0, running={LIVENESS}) == [READINESS]  # readiness is not held up by a slow liveness
    assert probes.due(12.0, running={LIVENESS}) == [READINESS]
    assert probes.due(12.5) == [LIVENESS]  # its result came after its period: it runs again at once


def test_a_kill_after_a_failed_probe_takes_the_probes_grace_and_the_prestop_hook() -> None:
    hook = {"preStop": {"exec": {"command": ["python3", "-c", "pass"]}}}
    container = {"livenessProbe": {"terminationGracePeriodSeconds": 30}, "startupProbe": {}, "lifecycle": hook}
    pod_spec = {"terminationGracePeriodSeconds": 930}
    assert kill_grace_s(pod_spec, container, LIVENESS) == 30
    assert kill_grace_s(pod_spec, container, STARTUP) == 930  # no grace of its own: the pod's
    assert kill_grace_s({}, container, READINESS) == 30  # the API's default pod grace
    assert prestop_command(container) == ("python3", "-c", "pass")
    assert prestop_command({}) == ()


def test_startup_gates_readiness_and_liveness_and_a_failing_liveness_probe_kills() -> None:
    health = {"httpGet": {"path": "/health", "port": 30001}}
    container = {
        "startupProbe": {**health, "periodSeconds": 10, "failureThreshold": 2},
        "readinessProbe": {**health, "periodSeconds": 5},
        "livenessProbe": {**health, "periodSeconds": 30, "failureThreshold": 2, "initialDelaySeconds": 1},
    }
    probes = ContainerProbes.for_container(container, started_at=100.0)
    assert (probes.started, probes.ready) == (False, False)
    assert probes.due(100.0) == [STARTUP]  # readiness and liveness wait for the startup probe
    assert probes.record(STARTUP, False) is Verdict.NOTHING
    assert probes.due(105.0) == []
    assert probes.due(110.0) == [STARTUP]
    assert probes.record(STARTUP, True) is Verdict.NOTHING
    assert probes.started
    assert probes.due(110.0) == [READINESS, "livenessProbe"]
    assert probes.record(READINESS, True) is Verdict.READY_CHANGED
    assert probes.ready
    assert probes.record("livenessProbe", False) is Verdict.NOTHING  # liveness starts healthy: one failure is fine
    assert probes.record("livenessProbe", False) is Verdict.KILL
    failing = ContainerProbes.for_container(container, started_at=0.0)
    assert [failing.record(STARTUP, False) for _ in range(2)] == [Verdict.NOTHING, Verdict.KILL]
    plain = ContainerProbes.for_container({"name": "c"}, started_at=0.0)
    assert (plain.started, plain.ready, plain.due(0.0)) == (True, True, [])


@pytest.fixture
async def health_server() -> AsyncIterator[tuple[int, dict[str, int]]]:
    answer = {"status": 503}

    async def health(_: web.Request) -> web.Response:
        return web.Response(status=answer["status"])

    app = web.Application()
    app.router.add_get("/health", health)
    runner = web.AppRunner(app)
    await runner.setup()
    port = free_port()
    await web.TCPSite(runner, "127.0.0.1", port).start()
    yield port, answer
    await runner.cleanup()


def _here(argv: Sequence[str]) -> list[str]:
    return list(argv)


@pytest.mark.procs
async def test_check_runs_http_tcp_and_exec_probes(health_server: tuple[int, dict[str, int]]) -> None:
    port, answer = health_server
    target = ProbeTarget("127.0.0.1", _here, {"PROBE_EXIT": "3"})
    http = Probe("httpGet", port=port, path="/health")
    async with aiohttp.ClientSession() as session:
        assert not await check(http, target, session)  # 503
        answer["status"] = 302  # the kubelet counts [200, 400) as success
        assert await check(http, target, session)
        assert await check(Probe("tcpSocket", port=port), target, session)
        assert not await check(Probe("tcpSocket", port=free_port()), target, session)
        assert not await check(Probe("exec", command=("sh", "-c", 'exit "$PROBE_EXIT"')), target, session)
        assert await check(Probe("exec", command=("true",)), target, session)
        slow = Probe("exec", command=("sleep", "5"), timing=ProbeTiming(timeout_s=0.2))
        assert not await check(slow, target, session)


POD: dict[str, Any] = {
    "metadata": {"name": "p", "uid": "u1"},
    "status": {
        "phase": "Running",
        "conditions": [
            {"type": "Initialized", "status": "True", "lastTransitionTime": "t0"},
            {"type": "Ready", "status": "False", "lastTransitionTime": "t0"},
            {"type": "ContainersReady", "status": "False", "lastTransitionTime": "t0"},
        ],
        "containerStatuses": [{"name": "sglang", "ready": False}],
    },
}


def _conditions(patch: dict[str, Any]) -> dict[str, str]:
    return {c["type"]: c["status"] for c in patch["status"]["conditions"]}


def test_status_patch_reports_readiness_exits_and_restarts_as_a_kubelet() -> None:
    running = ContainerView("sglang", "img", "t1")
    patch = status_patch(POD, running, "Never", "t2")
    assert _conditions(patch) == {"Initialized": "True", "Ready": "False", "ContainersReady": "False"}
    (status,) = patch["status"]["containerStatuses"]
    assert (status["ready"], status["started"], status["state"]) == (False, True, {"running": {"startedAt": "t1"}})

    patch = status_patch(POD, ContainerView("sglang", "img", "t1", ready=True), "Never", "t2")
    assert _conditions(patch)["Ready"] == "True"
    assert next(c for c in patch["status"]["conditions"] if c["type"] == "Ready")["lastTransitionTime"] == "t2"

    crashed = ContainerView("sglang", "img", "t1", terminated=Terminated(1, "t1", "t3"))
    patch = status_patch(POD, crashed, "Never", "t3")
    assert patch["status"]["phase"] == "Failed"
    (status,) = patch["status"]["containerStatuses"]
    assert status["state"]["terminated"] == {"exitCode": 1, "reason": "Error", "startedAt": "t1", "finishedAt": "t3"}
    assert status_patch(POD, crashed, "OnFailure", "t3")["status"]["phase"] == "Running"
    done = ContainerView("sglang", "img", "t1", terminated=Terminated(0, "t1", "t3"))
    assert status_patch(POD, done, "Never", "t3")["status"]["phase"] == "Succeeded"

    backing_off = ContainerView(
        "sglang",
        "img",
        "t1",
        restart_count=2,
        last_terminated=Terminated(2, "t1", "t3"),
        waiting_reason="CrashLoopBackOff",
    )
    (status,) = status_patch(POD, backing_off, "Always", "t4")["status"]["containerStatuses"]
    assert status["state"] == {"waiting": {"reason": "CrashLoopBackOff"}}
    assert (status["restartCount"], status["lastState"]["terminated"]["exitCode"]) == (2, 2)


def test_restart_policy_and_crash_loop_back_off() -> None:
    assert [restarts(policy, 1) for policy in ("Always", "OnFailure", "Never")] == [True, True, False]
    assert [restarts(policy, 0) for policy in ("Always", "OnFailure", "Never")] == [True, False, False]
    assert [backoff_s(n) for n in range(7)] == [0.0, 10.0, 20.0, 40.0, 80.0, 160.0, 300.0]
