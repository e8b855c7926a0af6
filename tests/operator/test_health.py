"""Health: probes that spare a loading or busy worker, readiness that only gates routing, a stuck-group deadline.

The reconcile runs against a fake Kube and registrar (tests/operator/fakes.py): pods are the operator's own
manifests with a status, as the API server returns them.
"""

from __future__ import annotations

import asyncio
from datetime import UTC, datetime, timedelta
from typing import Any

import pytest

from tandem.registry import Role
from tandem_operator.act.k8s.apply import object_path
from tandem_operator.api.pdcluster import PDClusterSpec
from tandem_operator.decide.observe import GroupKey, GroupState, GroupView
from tandem_operator.decide.recovery import Stuck, stuck_groups
from tandem_operator.desired.naming import ClusterRef
from tandem_operator.desired.pods import RoleContext, group_pod
from tandem_operator.desired.probes import GENERATION_CHECK_TIMEOUT_S, LONGEST_FORWARD_S
from tandem_operator.run.runtime import ClusterRuntime, RuntimeOptions
from tandem_sim.model.profiles import PROFILES
from tests.operator.conftest import kimi_spec
from tests.operator.fakes import FakeKube, FakeRegistrar, with_pools
from tests.operator.workers import CLUSTER, POOL, live_pod

SPEC = kimi_spec(transfer={"protocol": "tcp"})
NOW = datetime(2026, 1, 1, tzinfo=UTC)


def _container(spec: PDClusterSpec, rank: int = 0) -> dict[str, Any]:
    container: dict[str, Any] = group_pod(RoleContext.build(CLUSTER, spec, Role.DECODE, POOL), 0, rank)["spec"][
        "containers"
    ][0]
    return container


def test_probes_readiness_runs_no_generation_liveness_outlasts_the_longest_prefill() -> None:
    leader, member = _container(SPEC, 0), _container(SPEC, 1)
    startup, readiness, liveness = (leader[p] for p in ("startupProbe", "readinessProbe", "livenessProbe"))
    assert startup["periodSeconds"] * startup["failureThreshold"] >= 3600  # the default 60 min model load
    # readiness: SGLang's /ready on the leader (no generation: a long prefill cannot fail it); the other nodes
    # serve only SGLang's dummy health server, which has no /ready
    assert readiness["httpGet"]["path"] == "/ready"
    assert member["readinessProbe"]["httpGet"]["path"] == "/health"
    assert "terminationGracePeriodSeconds" not in readiness  # the API server refuses it on a readinessProbe
    # liveness and startup: a one-token generation, within SGLang's own timeout, which the operator sets longer
    # than the longest forward of the K2.6 profile (a 256K-token prompt in one batch)
    env = {v["name"]: v.get("value") for v in leader["env"]}
    timeout = int(env["SGLANG_HEALTH_CHECK_TIMEOUT"])
    longest = PROFILES["kimi-k2.6-h200"].prefill_s(262_144)
    assert longest == pytest.approx(LONGEST_FORWARD_S)
    assert longest == pytest.approx(40.1, abs=0.05)
    assert timeout == GENERATION_CHECK_TIMEOUT_S == 45 > longest
    for probe in (startup, liveness):
        assert probe["httpGet"]["path"] == "/health_generate"
        assert probe["timeoutSeconds"] == timeout + 5  # SGLang answers 503 itself by then
        # a kill on this probe has its own grace, not the pod's drain timeout + 30 s
        assert probe["terminationGracePeriodSeconds"] == 30
    assert leader["lifecycle"]["preStop"]["exec"]["command"][3].endswith("/ready")  # the hook gives up on it
    pod_grace = group_pod(RoleContext.build(CLUSTER, SPEC, Role.DECODE, POOL), 0, 0)["spec"]
    assert pod_grace["terminationGracePeriodSeconds"] == SPEC.lifecycle.drain_timeout_seconds + 30
    # a hung worker is killed after one check: at most period + timeout after its scheduler stopped
    assert liveness["failureThreshold"] == 1
    assert liveness["periodSeconds"] + timeout <= 60
    # a role's own SGLANG_HEALTH_CHECK_TIMEOUT wins, once in the env, and the probes follow it
    user = [{"name": "SGLANG_HEALTH_CHECK_TIMEOUT", "value": "60"}]
    slow = kimi_spec(
        decode={"groups": 1, "env": user}, lifecycle={"modelLoadTimeoutSeconds": 600, "startDeadlineSeconds": 900}
    )
    container = _container(slow)
    assert [v.get("value") for v in container["env"] if v["name"] == "SGLANG_HEALTH_CHECK_TIMEOUT"] == ["60"]
    assert container["livenessProbe"]["timeoutSeconds"] == container["startupProbe"]["timeoutSeconds"] == 65
    assert container["startupProbe"]["failureThreshold"] * container["startupProbe"]["periodSeconds"] == 600


def _member(created: datetime, started: bool | None, ready: bool = False, rank: int = 0) -> dict[str, Any]:
    pod = live_pod(SPEC, Role.DECODE, 0, rank, ready=ready)
    pod["metadata"]["creationTimestamp"] = created.strftime("%Y-%m-%dT%H:%M:%SZ")
    if started is None:
        pod["status"] = {"phase": "Pending"}
    else:
        pod["status"]["containerStatuses"] = [{"name": "sglang", "started": started, "restartCount": 0}]
    return pod


@pytest.mark.parametrize(
    ("state", "started", "age_s", "stuck"),
    [
        (GroupState.STARTING, None, 7200, True),  # Pending (unschedulable) past the deadline
        (GroupState.STARTING, False, 7200, True),  # never finished loading
        (GroupState.STARTING, False, 600, False),  # still within the deadline
        (GroupState.STARTING, True, 7200, False),  # loaded, merely NotReady (busy): readiness/liveness decide
        (GroupState.INCOMPLETE, True, 7200, True),  # a rank never came
        (GroupState.READY, True, 7200, False),
    ],
)
def test_stuck_groups(state: GroupState, started: bool | None, age_s: int, stuck: bool) -> None:
    pod = _member(NOW - timedelta(seconds=age_s), started)
    name = pod["metadata"]["name"]
    views = {0: GroupView(0, state, "h", (name,))}
    found = stuck_groups(Role.DECODE, views, {name: pod}, NOW, deadline_s=5400, download_deadline_s=21600)
    assert found == ({GroupKey(Role.DECODE, 0): Stuck(name)} if stuck else {})


def _cluster() -> tuple[ClusterRuntime, FakeKube, FakeRegistrar]:
    kube, registrar = FakeKube(), FakeRegistrar()
    ref = ClusterRef(CLUSTER.name, CLUSTER.namespace, CLUSTER.uid)
    with_pools(kube, ref, SPEC)
    for role, groups in ((Role.PREFILL, SPEC.prefill.groups), (Role.DECODE, SPEC.decode.groups)):
        for group in range(groups):
            for rank in range(SPEC.role(role).nodes_per_group):
                pod = live_pod(SPEC, role, group, rank, ip=f"10.0.{group}.{rank + (10 if role is Role.DECODE else 0)}")
                kube.objects[object_path(pod)] = pod
    runtime = ClusterRuntime(ref, SPEC, kube, registrar, RuntimeOptions("test"), dict)
    return runtime, kube, registrar


def _set_ready(kube: FakeKube, name: str, ready: bool) -> dict[str, Any]:
    pod = next(o for o in kube.objects.values() if o["metadata"]["name"] == name)
    pod["status"]["conditions"] = [{"type": "Ready", "status": "True" if ready else "False"}]
    return pod


async def test_a_notready_member_leaves_rotation_and_returns_with_the_same_epoch_not_recreated() -> None:
    runtime, kube, registrar = _cluster()
    await runtime.reconciler.reconcile_once()
    assert sorted(registrar.entries) == ["decode-0", "prefill-0", "prefill-1"]
    kube.calls.clear()

    assert await runtime.on_pod_event("MODIFIED", _set_ready(kube, "kimi-decode-0-1", ready=False)) is None
    assert "decode-0" not in registrar.entries  # out of rotation at once
    assert runtime.state.fenced == {}  # not a fence: no recovery, no recreation
    await runtime.reconciler.reconcile_once()
    assert "decode-0" not in registrar.entries
    await runtime.on_pod_event("MODIFIED", _set_ready(kube, "kimi-decode-0-1", ready=True))
    await runtime.reconciler.reconcile_once()
    assert registrar.entries["decode-0"].epoch == 0  # the same incarnation, registered again
    assert kube.verbs("delete") == []  # no pod was deleted
    assert [c[1] for c in kube.verbs("create")] == []
    await asyncio.sleep(0.05)  # Events are posted in the background
    reasons = [c[2]["reason"] for c in kube.verbs("post")]
    assert "Unrouted" in reasons
    assert "Fenced" not in reasons


async def test_a_member_whose_container_exited_gets_its_group_recreated() -> None:
    runtime, kube, _registrar = _cluster()
    await runtime.reconciler.reconcile_once()
    pod = _set_ready(kube, "kimi-decode-0-1", ready=False)
    pod["status"]["containerStatuses"] = [{"name": "sglang", "state": {"terminated": {"exitCode": 1}}}]
    fence = await runtime.on_pod_event("MODIFIED", pod)
    assert fence is not None
    assert fence.reason.value == "ContainerRestarted"
    await runtime.reconciler.reconcile_once()
    deleted = [c for c in kube.verbs("delete") if "/pods/kimi-decode-0-" in c[1]]
    assert len(deleted) == SPEC.decode.nodes_per_group
    assert {c[2] for c in deleted} == {0}  # grace 0: NCCL cannot lose a rank
    stamped = [c[2] for c in kube.verbs("apply") if c[1] == "kimi-decode-0"]
    assert stamped[-1]["metadata"]["annotations"]["tandem.dev/epoch"] == "1"


async def test_a_pass_that_changes_no_status_writes_none() -> None:
    runtime, kube, _registrar = _cluster()
    await runtime.reconciler.reconcile_once()
    statuses = {c[1] for c in kube.verbs("apply") if "status" in c[2]}
    assert statuses == {"kimi", "kimi-prefill", "kimi-decode"}
    kube.calls.clear()
    await runtime.reconciler.reconcile_once()
    assert kube.verbs("apply") == []  # nothing changed: no write
    await runtime.on_pod_event("MODIFIED", _set_ready(kube, "kimi-decode-0-1", ready=False))
    kube.calls.clear()
    await runtime.reconciler.reconcile_once()
    assert {c[1] for c in kube.verbs("apply") if "status" in c[2]} == {"kimi", "kimi-decode"}


async def test_one_registered_event_per_pass_names_every_group() -> None:
    runtime, kube, _registrar = _cluster()
    await runtime.reconciler.reconcile_once()
    await asyncio.sleep(0.05)  # Events are posted in the background
    [registered] = [c[2] for c in kube.verbs("post") if c[2]["reason"] == "Registered"]
    assert registered["note"].startswith("3 groups registered: ")
    assert all(f"group {name} epoch 0" in registered["note"] for name in ("prefill-0", "prefill-1", "decode-0"))
