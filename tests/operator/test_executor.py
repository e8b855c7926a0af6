"""The planner's steps carry every choice (epoch, Service, grace, Event); the executor only carries them out.

Tested with a fake Kube and registrar (tests/operator/fakes.py): no API server, no etcd.
"""

from __future__ import annotations

import asyncio

from tandem.registry import Role
from tandem_operator.act.executor import Executor
from tandem_operator.decide.observe import GroupKey, GroupState, GroupView
from tandem_operator.decide.planner import (
    CreateGroup,
    CreatePods,
    DeleteGroup,
    DeletePods,
    DeleteReason,
    Observed,
    steps,
)
from tandem_operator.decide.reasons import Reason
from tandem_operator.decide.state import ClusterState
from tandem_operator.desired.pods import RoleContext
from tests.operator.conftest import kimi_spec
from tests.operator.fakes import FakeKube, FakeRegistrar
from tests.operator.workers import CLUSTER, POOL, live_pod

SPEC = kimi_spec()
CTX = RoleContext.build(CLUSTER, SPEC, Role.DECODE, POOL)
NODES = SPEC.decode.nodes_per_group
KEY = GroupKey(Role.DECODE, 1)


def group(state: GroupState, epoch: int = 2, terminating: int | None = None) -> tuple[GroupView, Observed]:
    pods = {}
    for rank in range(NODES):
        pod = live_pod(SPEC, Role.DECODE, 1, rank, epoch=epoch)
        if rank == terminating:
            pod["metadata"]["deletionTimestamp"] = "2026-01-01T00:00:00Z"
        pods[pod["metadata"]["name"]] = pod
    view = GroupView(1, state, CTX.template_hash, tuple(sorted(pods)))
    return view, Observed(pods, {KEY: epoch}, {KEY: epoch}, frozenset())


def test_broken_group_gets_the_next_epoch_grace_zero_and_no_unregister() -> None:
    view, seen = group(GroupState.BROKEN, terminating=0)
    (step,) = steps(CTX, [DeleteGroup(1, DeleteReason.BROKEN)], {1: view}, seen)
    assert isinstance(step, DeletePods)
    assert (step.unregister, step.delete_service, step.stamp_service, step.grace_seconds) == (False, False, True, 0)
    assert step.service["metadata"]["annotations"]["tandem.dev/epoch"] == "3"
    assert len(step.pods) == NODES - 1  # the terminating member is not deleted again
    assert step.event is Reason.GROUP_RECREATING


def test_scale_down_unregisters_and_deletes_the_service() -> None:
    view, seen = group(GroupState.READY)
    (step,) = steps(CTX, [DeleteGroup(1, DeleteReason.SCALE_DOWN)], {1: view}, seen)
    assert isinstance(step, DeletePods)
    assert (step.unregister, step.delete_service, step.grace_seconds, step.event) == (
        True,
        True,
        None,
        Reason.SCALED_DOWN,
    )


def test_new_group_is_created_at_the_service_epoch_with_a_scale_up_event() -> None:
    seen = Observed({}, {KEY: 4}, {}, frozenset())
    (step,) = steps(CTX, [CreateGroup(1)], {}, seen)
    assert isinstance(step, CreatePods)
    assert step.epoch == 4
    assert step.event is Reason.SCALED_UP
    kinds = [m["kind"] for m in step.manifests]
    assert kinds == ["Service", "PodDisruptionBudget", *["Pod"] * NODES]
    stamped = [m for m in step.manifests if m["kind"] in ("Service", "Pod")]
    assert {m["metadata"]["annotations"]["tandem.dev/epoch"] for m in stamped} == {"4"}


def test_a_fenced_group_recreated_reports_recreating() -> None:
    seen = Observed({}, {KEY: 4}, {}, frozenset({KEY}))
    (step,) = steps(CTX, [CreateGroup(1)], {}, seen)
    assert isinstance(step, CreatePods)
    assert step.event is Reason.GROUP_RECREATING


async def test_executor_unregisters_before_deleting_pods_and_posts_the_event() -> None:
    kube = FakeKube()
    log: list[tuple[str, str, object]] = []
    registrar = FakeRegistrar(log)
    state = ClusterState(CLUSTER, SPEC)
    executor = Executor(state, kube, registrar, "test")
    view, seen = group(GroupState.STARTING)  # never served: nothing to drain (tests/operator/test_drain.py)
    (step,) = steps(CTX, [DeleteGroup(1, DeleteReason.SCALE_DOWN)], {1: view}, seen)
    assert isinstance(step, DeletePods)
    assert step.drain is None
    original = kube.delete

    async def delete(path: str, grace_seconds: int | None = None) -> bool:
        log.append(("delete", path, grace_seconds))
        return await original(path, grace_seconds)

    kube.delete = delete  # type: ignore[method-assign]
    await executor.delete(step)
    await asyncio.sleep(0)  # the Event is posted in the background
    assert log[0] == ("unregister", "decode-1", None)
    assert [c[1].rsplit("/", 2)[-2] for c in log[1:]] == ["services", "poddisruptionbudgets", *["pods"] * NODES]
    assert KEY in state.retiring
    (event,) = kube.verbs("post")
    assert event[2]["reason"] == "ScaledDown"


async def test_executor_applies_the_service_before_the_pods() -> None:
    kube = FakeKube()
    executor = Executor(ClusterState(CLUSTER, SPEC), kube, FakeRegistrar(), "test")
    (step,) = steps(CTX, [CreateGroup(1)], {}, Observed({}, {}, {}, frozenset()))
    assert isinstance(step, CreatePods)
    await executor.create(step)
    applied = [c[2]["kind"] for c in kube.verbs("apply")]
    assert applied == ["Service", "PodDisruptionBudget", *["Pod"] * NODES]
