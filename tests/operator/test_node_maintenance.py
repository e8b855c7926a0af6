"""Node maintenance and rollouts without spare nodes (issue #34, parts 3 and 4).

A cordoned node (``kubectl drain``, cluster-autoscaler, a managed node upgrade) has its groups drained by the
operator (unregister, in-flight work ends, pods deleted gracefully, Service and PodDisruptionBudget deleted) and
created elsewhere; the PodDisruptionBudget refuses the eviction until then. The runtime and its reconcile pass run
against a fake Kube and registrar (tests/operator/fakes.py), every worker pod on a node of its own; the cordons are
what the operator's node handler hands each runtime (``fencing.node_cordoned`` of the Node events).
"""

from __future__ import annotations

import asyncio
from datetime import UTC, datetime
from typing import Any

import pydantic
import pytest

from tandem.registry import Role
from tandem_operator.act.k8s.apply import object_path
from tandem_operator.api.pdcluster import PDClusterSpec
from tandem_operator.decide.fencing import NodeVerdicts, groups_on_nodes, node_cordoned, node_verdicts
from tandem_operator.decide.observe import GroupKey, GroupState, GroupView
from tandem_operator.decide.planner import (
    Action,
    CreateGroup,
    DeleteGroup,
    DeletePods,
    DeleteReason,
    Observed,
    plan,
    steps,
)
from tandem_operator.desired.naming import ANNOTATION_EPOCH, ClusterRef, compat_revision
from tandem_operator.desired.pods import RoleContext, group_pod
from tandem_operator.run.render import InvalidClusterError, render
from tandem_operator.run.runtime import ClusterRuntime, RuntimeOptions
from tests.operator.conftest import kimi_spec, role_hash
from tests.operator.fakes import FakeKube, FakeRegistrar, with_pools
from tests.operator.workers import CLUSTER, POOL, live_pod

SPEC = kimi_spec(transfer={"protocol": "tcp"})
NODE = "gpu-decode-0-1"  # the node of decode-0's rank 1
R, S, B = GroupState.READY, GroupState.STARTING, GroupState.BROKEN
NEW, OLD = "new", "old"


def _node(role: Role, group: int, rank: int) -> str:
    return f"gpu-{role.value}-{group}-{rank}"


def _cluster(spec: PDClusterSpec = SPEC) -> tuple[ClusterRuntime, FakeKube, FakeRegistrar, set[str]]:
    kube, registrar, cordoned = FakeKube(), FakeRegistrar(), set[str]()
    ref = ClusterRef(CLUSTER.name, CLUSTER.namespace, CLUSTER.uid)
    with_pools(kube, ref, spec)
    for role in Role:
        for group in range(spec.role(role).groups):
            for rank in range(spec.role(role).nodes_per_group):
                ip = f"10.0.{group}.{rank + (10 if role is Role.DECODE else 0)}"
                pod = live_pod(spec, role, group, rank, ip=ip, node=_node(role, group, rank))
                kube.objects[object_path(pod)] = pod
    runtime = ClusterRuntime(ref, spec, kube, registrar, RuntimeOptions("test"), dict, lambda: frozenset(cordoned))
    return runtime, kube, registrar, cordoned


def _in_flight(runtime: ClusterRuntime, counts: dict[str, int]) -> list[str]:
    """The leaders' in-flight gauges as the drain reads them (``counts`` by URL host, 0 when absent)."""
    asked: list[str] = []

    async def in_flight(url: str) -> int | None:
        asked.append(url)
        return counts.get(url.split("//", 1)[1].split(":", 1)[0], 0)

    runtime.executor.worker_metrics.in_flight = in_flight  # type: ignore[method-assign]
    return asked


async def _event_reasons(kube: FakeKube) -> list[str]:
    await asyncio.sleep(0.05)  # Events are posted in the background
    return [c[2]["reason"] for c in kube.verbs("post")]


async def test_a_cordoned_nodes_group_is_drained_deleted_and_created_elsewhere(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr("tandem_operator.decide.drain.SETTLE_S", 0.0)  # the settle time is drain.py's own, tested there
    runtime, kube, registrar, cordoned = _cluster()
    leader = "10.0.0.10"  # decode-0's rank 0
    counts = {leader: 3}
    asked = _in_flight(runtime, counts)
    await runtime.reconciler.reconcile_once()
    assert sorted(registrar.entries) == ["decode-0", "prefill-0", "prefill-1"]
    kube.calls.clear()

    cordoned.add(NODE)  # kubectl drain cordons first; its evictions meet the PodDisruptionBudget meanwhile
    assert await runtime.reconciler.reconcile_once()  # still draining: 3 requests in flight
    assert "decode-0" not in registrar.entries  # out of routing first
    assert asked[-1] == f"http://{leader}:{SPEC.decode.ports.http}/metrics"
    assert [c for c in kube.verbs("delete") if "/pods/" in c[1]] == []  # in-flight work is let finish
    created = [c[1] for c in kube.verbs("apply") if c[2]["kind"] == "Pod"]
    assert created == ["kimi-decode-1-0", "kimi-decode-1-1"]  # the replacement starts at once, elsewhere

    counts[leader] = 0
    assert not await runtime.reconciler.reconcile_once()
    deleted = [c for c in kube.verbs("delete") if "kimi-decode-0" in c[1]]
    pods = [c for c in deleted if "/pods/" in c[1]]
    assert {c[1].rsplit("/", 1)[1] for c in pods} == {"kimi-decode-0-0", "kimi-decode-0-1"}
    assert {c[2] for c in pods} == {None}  # the pods' own grace (their preStop hook), not 0
    gone = {c[1] for c in deleted if "/pods/" not in c[1]}
    assert gone == {
        f"/api/v1/namespaces/{CLUSTER.namespace}/services/kimi-decode-0",
        f"/apis/policy/v1/namespaces/{CLUSTER.namespace}/poddisruptionbudgets/kimi-decode-0",
    }
    assert runtime.state.fenced == {}  # a move, not a recovery
    reasons = await _event_reasons(kube)
    assert "NodeCordoned" in reasons
    assert "Draining" in reasons
    assert "Fenced" not in reasons
    assert sorted(registrar.entries) == ["prefill-0", "prefill-1"]  # the other groups are untouched


async def test_an_uncordoned_node_moves_nothing_and_a_cordon_elsewhere_neither() -> None:
    runtime, kube, registrar, cordoned = _cluster()
    _in_flight(runtime, {})
    cordoned.add("some-other-node")
    await runtime.reconciler.reconcile_once()
    assert sorted(registrar.entries) == ["decode-0", "prefill-0", "prefill-1"]
    assert kube.verbs("delete") == []


def test_node_cordoned_and_the_groups_on_nodes() -> None:
    node: dict[str, Any] = {"metadata": {"name": NODE}, "spec": {"unschedulable": True}}
    assert node_cordoned("MODIFIED", node)
    assert node_cordoned("None", node)  # kopf's initial listing
    assert not node_cordoned("DELETED", node)  # a deleted node's groups are lost, not moved
    assert not node_cordoned("MODIFIED", {"metadata": {"name": NODE}, "spec": {}})
    ctx = RoleContext.build(CLUSTER, SPEC, Role.DECODE, POOL)
    pods = [{**group_pod(ctx, 0, rank), "spec": {"nodeName": _node(Role.DECODE, 0, rank)}} for rank in range(2)]
    assert groups_on_nodes(pods, {NODE}) == {GroupKey(Role.DECODE, 0)}
    assert groups_on_nodes(pods, {"elsewhere"}) == frozenset()
    assert node_verdicts({}, 300, datetime.now(UTC), {NODE}) == NodeVerdicts(cordoned=frozenset({NODE}))


# -- the planner ---------------------------------------------------------------------------------------------------


def _groups(*specs: tuple[int, GroupState, str]) -> dict[int, GroupView]:
    return {i: GroupView(i, state, template, (), revision=f"rev-{template}") for i, state, template in specs}


@pytest.mark.parametrize("max_surge", [0, 1])
def test_plan_moves_a_cordoned_group_and_creates_its_replacement_at_once(max_surge: int) -> None:
    views = _groups((0, R, NEW), (1, R, NEW))
    assert plan(2, views, NEW, max_surge, cordoned=frozenset({1})) == [
        DeleteGroup(1, DeleteReason.NODE_CORDONED),
        CreateGroup(2),
    ]
    # The next pass: the moving group (draining) is the surplus and keeps its reason; nothing more is created.
    moving = {**views, 2: GroupView(2, S, NEW, ())}
    assert plan(2, moving, NEW, max_surge, retiring=frozenset({1}), cordoned=frozenset({1})) == [
        DeleteGroup(1, DeleteReason.NODE_CORDONED)
    ]
    # A broken group on a cordoned node is recreated as any broken group (grace 0), under its own index.
    assert plan(2, _groups((0, R, NEW), (1, B, NEW)), NEW, max_surge, cordoned=frozenset({1})) == [
        DeleteGroup(1, DeleteReason.BROKEN)
    ]


def test_a_scale_down_takes_the_group_on_a_cordoned_node_first() -> None:
    views = _groups((0, R, NEW), (1, R, NEW), (2, R, NEW))
    assert plan(2, views, NEW, 1) == [DeleteGroup(2, DeleteReason.SCALE_DOWN)]
    assert plan(2, views, NEW, 1, cordoned=frozenset({0})) == [DeleteGroup(0, DeleteReason.NODE_CORDONED)]
    # ... before a not-ready one, which would otherwise go first
    starting = {**views, 1: GroupView(1, S, NEW, ())}
    assert plan(2, starting, NEW, 1, cordoned=frozenset({0})) == [DeleteGroup(0, DeleteReason.NODE_CORDONED)]


def test_an_in_place_rollout_waits_while_a_group_moves_off_a_cordoned_node() -> None:
    views = _groups((0, R, OLD), (1, R, OLD))
    assert plan(2, views, NEW, 0) == [DeleteGroup(1, DeleteReason.ROLLOUT)]
    # One group out at a time: the move first, the rollout step once every group is Ready again.
    assert plan(2, views, NEW, 0, cordoned=frozenset({0})) == [
        DeleteGroup(0, DeleteReason.NODE_CORDONED),
        CreateGroup(2),
    ]


def test_in_place_keeps_the_revision_rule_with_several_groups_and_cannot_with_one() -> None:
    old_only = ("rev-new", frozenset({"rev-old"}))
    both = ("rev-new", frozenset({"rev-old", "rev-new"}))
    views = _groups((0, R, OLD), (1, R, OLD))
    assert plan(2, views, NEW, 0, revisions=old_only) == [DeleteGroup(1, DeleteReason.ROLLOUT)]
    half = _groups((0, R, OLD), (1, R, NEW))
    assert plan(2, half, NEW, 0, revisions=old_only) == []  # the last old group waits for a new pair
    assert plan(2, half, NEW, 0, revisions=both) == [DeleteGroup(0, DeleteReason.ROLLOUT)]
    # A role of one group has no other to serve meanwhile: waiting would never end.
    assert plan(1, _groups((0, R, OLD)), NEW, 0, revisions=old_only) == [DeleteGroup(0, DeleteReason.ROLLOUT)]


def _roll(desired: int, nodes: int, max_surge: int, rounds: int = 30) -> dict[int, GroupView]:
    """A toy world of ``nodes`` one-group nodes: a created group holds a node and is Ready the next round if one
    is free, else stays Pending (STARTING); a deleted group frees its node the next round."""
    world = _groups(*((i, R, OLD) for i in range(desired)))
    for _ in range(rounds):
        actions = plan(desired, world, NEW, max_surge)
        deleted = {a.index for a in actions if isinstance(a, DeleteGroup)}
        nxt = {i: g for i, g in world.items() if i not in deleted}
        for action in actions:
            if isinstance(action, CreateGroup):
                nxt[action.index] = GroupView(action.index, S, NEW, ())
        placed = sum(g.state is R for g in nxt.values())
        for i, g in sorted(nxt.items()):
            if g.state is S and placed < nodes:
                nxt[i], placed = GroupView(i, R, NEW, ()), placed + 1
        world = nxt
    return world


def test_without_a_spare_node_in_place_completes_and_surge_never_starts() -> None:
    done = _roll(desired=3, nodes=3, max_surge=0)
    assert sorted((g.state, g.template_hash) for g in done.values()) == [(R, NEW)] * 3
    stuck = _roll(desired=3, nodes=3, max_surge=1)
    assert sorted((g.state, g.template_hash) for g in stuck.values()) == [(R, OLD)] * 3 + [(S, NEW)]
    assert sorted(g.template_hash for g in _roll(desired=3, nodes=4, max_surge=1).values()) == [NEW] * 3


# -- model.cachedNodeLabel -----------------------------------------------------------------------------------------

LABEL = "models.example.com/kimi-k2.6"


def test_pods_prefer_nodes_that_hold_the_weights_without_rolling_anything() -> None:
    cached = kimi_spec(transfer={"protocol": "tcp"}, model={"cachedNodeLabel": LABEL})
    for role in Role:
        for spec, expected in ((SPEC, None), (cached, LABEL)):
            ctx = RoleContext.build(CLUSTER, spec, role, POOL)
            for rank in range(spec.role(role).nodes_per_group):
                affinity = group_pod(ctx, 0, rank)["spec"]["affinity"]
                assert "podAntiAffinity" in affinity  # required placement unchanged
                preferred = (affinity.get("nodeAffinity") or {}).get("preferredDuringSchedulingIgnoredDuringExecution")
                if expected is None:
                    assert preferred is None
                    continue
                assert preferred == [
                    {"weight": 100, "preference": {"matchExpressions": [{"key": LABEL, "operator": "Exists"}]}}
                ]
                assert "requiredDuringSchedulingIgnoredDuringExecution" not in affinity["nodeAffinity"]
        # a scheduling preference of new pods: no pod rolls, no revision changes
        assert role_hash(cached, role) == role_hash(SPEC, role)
    assert compat_revision(cached) == compat_revision(SPEC)


def test_a_malformed_cached_node_label_is_refused_naming_the_field() -> None:
    doc = {
        "apiVersion": "tandem.dev/v1alpha1",
        "kind": "PDCluster",
        "metadata": {"name": "kimi"},
        "spec": {**SPEC.to_wire(), "model": {"cachedNodeLabel": "not a label"}},
    }
    with pytest.raises(InvalidClusterError) as err:
        render(doc)
    [message] = err.value.messages
    assert message.startswith('spec.model.cachedNodeLabel: Invalid value: "not a label": spec.model.cachedNodeLabel')
    with pytest.raises(pydantic.ValidationError, match="cachedNodeLabel"):
        kimi_spec(transfer={"protocol": "tcp"}, model={"cachedNodeLabel": ""})


def test_a_replaced_group_is_stamped_with_the_next_epoch_once_however_long_it_drains() -> None:
    """Each pass of a drain plans the retirement again: the Service keeps the epoch the first pass stamped, so the
    replacement's ports (rotated by epoch) differ from its predecessor's whatever the number of passes."""
    ctx = RoleContext.build(CLUSTER, SPEC, Role.DECODE, POOL)
    key = GroupKey(Role.DECODE, 0)
    views = {0: GroupView(0, R, "old", ("kimi-decode-0-0", "kimi-decode-0-1"))}
    action: list[Action] = [DeleteGroup(0, DeleteReason.ROLLOUT)]
    first = steps(ctx, action, views, Observed({}, {key: 4}, {key: 4}, frozenset()))
    later = steps(ctx, action, views, Observed({}, {key: 5}, {key: 4}, frozenset()))
    for step, stamped in ((first[0], True), (later[0], False)):
        assert isinstance(step, DeletePods)
        assert step.stamp_service is stamped
        assert step.service["metadata"]["annotations"][ANNOTATION_EPOCH] == "5"
