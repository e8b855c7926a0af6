"""Upgrades without surprises (upgrade.py, api/upgrade.py, desired/compare.py): an operator-only change of rendering
waits for spec.upgradePolicy, a spec change rolls at once; the PodsOutdated condition; refused policies and
triggers name their field."""

from __future__ import annotations

from datetime import UTC, datetime

import pytest

from tandem.registry import Role
from tandem_operator.api.common import ConditionStatus
from tandem_operator.api.upgrade import InvalidTriggerError, MaintenanceWindow, UpgradePolicy, parse_trigger
from tandem_operator.decide.observe import GroupState, GroupView
from tandem_operator.decide.planner import CreateGroup, CreatePods, DeleteGroup, DeleteReason, Observed, plan, steps
from tandem_operator.decide.upgrade import (
    RoleUpgrade,
    gate,
    hold,
    next_opening,
    operator_only,
    pods_outdated_condition,
    restamp,
    trigger_done,
    window_open,
)
from tandem_operator.desired.compare import differences, drift
from tandem_operator.desired.naming import ANNOTATION_DESIRED_HASH, ANNOTATION_GENERATION, ClusterRef, OwnerRef
from tandem_operator.desired.pods import RoleContext, group_pod
from tandem_operator.run.render import InvalidClusterError, render
from tests.operator.conftest import kimi_spec

R, S, B = GroupState.READY, GroupState.STARTING, GroupState.BROKEN
OLD, NEW = "old", "new"
GEN = 7
MANUAL = UpgradePolicy()
ON_CHANGE = UpgradePolicy.model_validate({"roll": "OnChange"})
# Saturdays 02:00 UTC for 3 hours
WINDOW = UpgradePolicy.model_validate(
    {"roll": "Window", "window": {"days": ["Sat"], "start": "02:00", "durationMinutes": 180}}
)
SAT_3AM = datetime(2026, 5, 2, 3, 0, tzinfo=UTC)  # a Saturday
SAT_6AM = datetime(2026, 5, 2, 6, 0, tzinfo=UTC)


def view(i: int, state: GroupState = R, hash_: str = OLD, gen: int | None = GEN, desired: str = OLD) -> GroupView:
    return GroupView(i, state, hash_, (f"p{i}",), "rev", gen, desired)


def roles(upgrade: RoleUpgrade) -> tuple[tuple[int, ...], tuple[int, ...]]:
    return upgrade.outdated, upgrade.held


# -- operator-only or spec change --------------------------------------------------------------------------------


def test_an_operator_only_change_is_told_from_a_spec_change() -> None:
    assert operator_only(view(0), NEW, GEN)  # same generation: the operator renders differently
    assert operator_only(view(0, gen=None, desired=""), NEW, GEN)  # pods from before the stamps
    assert not operator_only(view(0, gen=GEN - 1), NEW, GEN)  # the user changed the spec, and what is wanted moved
    # the spec changed since, but the operator wants what it wanted then (an unrelated field): still operator-only
    assert operator_only(view(0, gen=GEN - 1, desired=NEW), NEW, GEN)
    assert not operator_only(view(0, hash_=NEW), NEW, GEN)  # current
    assert not operator_only(view(0, hash_=""), NEW, GEN)  # ranks disagree (half created)


@pytest.mark.parametrize(
    ("policy", "now", "trigger", "held"),
    [
        (MANUAL, SAT_3AM, frozenset(), (0, 1)),  # default: never without the user's word
        (MANUAL, SAT_3AM, frozenset({Role.DECODE}), ()),  # the trigger names the role
        (MANUAL, SAT_3AM, frozenset({Role.PREFILL}), (0, 1)),  # ... or only the other one
        (ON_CHANGE, SAT_6AM, frozenset(), ()),
        (WINDOW, SAT_3AM, frozenset(), ()),  # window open
        (WINDOW, SAT_6AM, frozenset(), (0, 1)),  # window closed
        (WINDOW, SAT_6AM, frozenset({Role.DECODE}), ()),  # the trigger works under any policy
    ],
)
def test_operator_only_changes_roll_per_policy(
    policy: UpgradePolicy, now: datetime, trigger: frozenset[Role], held: tuple[int, ...]
) -> None:
    views = {0: view(0), 1: view(1, S), 2: view(2, B), 3: view(3, hash_=NEW)}
    upgrade = gate(Role.DECODE, views, NEW, GEN, policy, trigger, now)
    assert roles(upgrade) == ((0, 1), held)  # a broken group is recreated anyway; group 3 is current
    actions = plan(4, hold(views, upgrade, NEW), NEW, max_surge=1)
    assert DeleteGroup(2, DeleteReason.BROKEN) in actions
    assert (DeleteGroup(1, DeleteReason.ROLLOUT) in actions) == (not held)  # the Starting one is replaced at once
    assert (CreateGroup(4) in actions) == (not held)  # surging only when something rolls


@pytest.mark.parametrize("policy", [MANUAL, WINDOW, ON_CHANGE])
def test_a_spec_change_rolls_at_once_whatever_the_policy(policy: UpgradePolicy) -> None:
    views = {0: view(0, gen=GEN - 1), 1: view(1, gen=GEN - 1)}
    upgrade = gate(Role.PREFILL, views, NEW, GEN, policy, frozenset(), SAT_6AM)
    assert roles(upgrade) == ((), ())
    assert hold(views, upgrade, NEW) == views
    assert CreateGroup(2) in plan(2, views, NEW, max_surge=1)  # surge: the rollout starts


def test_restamped_groups_stay_held_across_an_unrelated_spec_edit() -> None:
    views = {0: view(0, gen=None, desired=""), 1: view(1, hash_=NEW, gen=GEN - 1, desired=NEW), 2: view(2, B)}
    assert restamp(views, NEW, GEN) == (0, 1)  # outdated by the operator, and current: both stamped (G, H)
    stamped = {0: view(0, gen=GEN, desired=NEW), 1: view(1, hash_=NEW, gen=GEN, desired=NEW)}
    assert restamp(stamped, NEW, GEN) == ()
    # the user edits a field that renders nothing (generation 8): group 0 is still held, nothing rolls
    assert roles(gate(Role.DECODE, stamped, NEW, GEN + 1, MANUAL, frozenset(), SAT_3AM)) == ((0,), (0,))
    # the user edits a field that changes the pods (the wanted hash moves): group 0 and 1 roll at once
    assert roles(gate(Role.DECODE, stamped, "newer", GEN + 1, MANUAL, frozenset(), SAT_3AM)) == ((), ())


def test_new_pods_carry_the_generation_and_the_wanted_hash() -> None:
    ctx = RoleContext.build(ClusterRef("c", "ns", "u"), kimi_spec(), Role.PREFILL, OwnerRef("v", "PDPool", "p", "u"))
    (create,) = steps(ctx, [CreateGroup(0)], {}, Observed({}, {}, {}, frozenset(), generation=GEN))
    assert isinstance(create, CreatePods)
    pods = [m for m in create.manifests if m["kind"] == "Pod"]
    assert pods
    assert all(
        p["metadata"]["annotations"][ANNOTATION_GENERATION] == str(GEN)
        and p["metadata"]["annotations"][ANNOTATION_DESIRED_HASH] == ctx.template_hash
        for p in pods
    )


# -- window, trigger ---------------------------------------------------------------------------------------------


def test_a_window_past_midnight_and_its_next_opening() -> None:
    late = MaintenanceWindow.model_validate({"days": ["Sun"], "start": "23:00", "durationMinutes": 120})
    assert window_open(late, datetime(2026, 5, 3, 23, 30, tzinfo=UTC))  # Sunday 23:30
    assert window_open(late, datetime(2026, 5, 4, 0, 59, tzinfo=UTC))  # Monday 00:59, opened Sunday
    assert not window_open(late, datetime(2026, 5, 4, 1, 0, tzinfo=UTC))
    assert not window_open(late, datetime(2026, 5, 3, 22, 59, tzinfo=UTC))
    assert next_opening(late, datetime(2026, 5, 4, 1, 0, tzinfo=UTC)) == datetime(2026, 5, 10, 23, 0, tzinfo=UTC)


def test_the_trigger_names_roles_and_is_done_when_they_rolled() -> None:
    assert parse_trigger(None) == frozenset()
    assert parse_trigger("prefill, decode") == parse_trigger("all") == frozenset(Role)
    assert parse_trigger("decode") == frozenset({Role.DECODE})
    for bad in ("router", "prefill,", ""):
        with pytest.raises(InvalidTriggerError, match=r"metadata.annotations\[tandem.dev/roll\]: Invalid value"):
            parse_trigger(bad)
    rolling, done = RoleUpgrade(Role.DECODE, (1,), ()), RoleUpgrade(Role.PREFILL, (), ())
    assert not trigger_done(frozenset({Role.DECODE}), [rolling, done])
    assert trigger_done(frozenset({Role.PREFILL}), [rolling, done])
    assert not trigger_done(frozenset(), [done])


def _doc(**spec: object) -> dict[str, object]:
    body = {**kimi_spec(transfer={"protocol": "tcp"}).to_wire(), **spec}
    return {"apiVersion": "tandem.dev/v1alpha1", "kind": "PDCluster", "metadata": {"name": "c"}, "spec": body}


@pytest.mark.parametrize(
    ("policy", "message"),
    [
        (
            {"roll": "Window"},
            'spec.upgradePolicy.window: Invalid value: "object": upgradePolicy.window is required with roll: Window '
            "(days, start, durationMinutes)",
        ),
        (
            {"roll": "Window", "window": {"days": ["Caturday"], "start": "02:00", "durationMinutes": 60}},
            'spec.upgradePolicy.window.days[0]: Unsupported value: "Caturday": supported values: "Mon", "Tue", '
            '"Wed", "Thu", "Fri", "Sat", "Sun"',
        ),
        (
            {"roll": "Sometimes"},
            'spec.upgradePolicy.roll: Unsupported value: "Sometimes": supported values: "OnChange", "Window", "Manual"',
        ),
    ],
)
def test_a_policy_naming_what_does_not_exist_is_refused_naming_the_field(
    policy: dict[str, object], message: str
) -> None:
    with pytest.raises(InvalidClusterError) as err:
        render(_doc(upgradePolicy=policy))
    assert err.value.messages == [message]


def test_a_trigger_naming_an_unknown_role_is_refused_naming_the_annotation() -> None:
    doc = _doc()
    doc["metadata"] = {"name": "c", "annotations": {"tandem.dev/roll": "prefill,router"}}
    with pytest.raises(InvalidClusterError) as err:
        render(doc)
    assert err.value.messages == [
        'metadata.annotations[tandem.dev/roll]: Invalid value: "prefill,router": roles are prefill, decode, all '
        "(comma-separated)"
    ]


# -- the condition and the difference ----------------------------------------------------------------------------


def test_the_condition_lists_roles_the_difference_and_how_to_roll() -> None:
    upgrades = [RoleUpgrade(Role.PREFILL, (0, 1), (0, 1)), RoleUpgrade(Role.DECODE, (), ())]
    changes = {Role.PREFILL: ["env added SGLANG_X=1", "flag --foo: 'a' -> 'b'"]}
    cond = pods_outdated_condition(upgrades, changes, MANUAL, "kimi", None, GEN, [], SAT_3AM)
    assert (cond.status, cond.reason) == (ConditionStatus.TRUE, "OperatorRenderingChanged")
    assert cond.message == (
        "prefill: 2 group(s) held, pods differ from this operator's rendering with the spec unchanged: "
        "env added SGLANG_X=1; flag --foo: 'a' -> 'b'. upgradePolicy Manual: roll with: "
        "kubectl annotate pdcluster/kimi tandem.dev/roll=prefill"
    )
    window = pods_outdated_condition(upgrades, changes, WINDOW, "kimi", None, GEN, [], SAT_6AM)
    assert "rolls when the window opens (Sat 2026-05-09T02:00Z)" in window.message
    clear = pods_outdated_condition([RoleUpgrade(Role.DECODE, (), ())], {}, MANUAL, "kimi", None, GEN, [], SAT_3AM)
    assert (clear.status, clear.reason) == (ConditionStatus.FALSE, "UpToDate")
    bad = pods_outdated_condition([], {}, MANUAL, "kimi", "metadata.annotations[tandem.dev/roll]: x", GEN, [], SAT_3AM)
    assert (bad.reason, bad.message) == ("InvalidRollTrigger", "metadata.annotations[tandem.dev/roll]: x")


def test_the_difference_names_image_flags_and_env_and_ignores_api_server_defaults() -> None:
    ctx = RoleContext.build(ClusterRef("c", "ns", "u"), kimi_spec(), Role.PREFILL, OwnerRef("v", "PDPool", "p", "u"))
    desired = group_pod(ctx, 0, 0)
    live = group_pod(ctx, 0, 0)
    container = live["spec"]["containers"][0]
    container["readinessProbe"] = {**container["readinessProbe"], "successThreshold": 1}  # defaulted
    container["terminationMessagePath"] = "/dev/termination-log"
    live["spec"]["schedulerName"] = "default-scheduler"
    live["spec"]["volumes"].append({"name": "kube-api-access-x", "projected": {"sources": []}})  # admission
    container["volumeMounts"].append({"name": "kube-api-access-x", "mountPath": "/var/run/secrets"})
    for var in container["env"]:
        if "valueFrom" in var:
            var["valueFrom"] = {"fieldRef": {"apiVersion": "v1", **var["valueFrom"]["fieldRef"]}}
    assert drift(live, desired) == []
    container["image"] = "old:1"
    container["args"] = [a for a in container["args"] if a != "--trust-remote-code"] + ["--log-level", "debug"]
    container["env"] = [e for e in container["env"] if e["name"] != "MC_TE_METRIC"]
    container["livenessProbe"] = {"httpGet": {"path": "/health", "port": "http"}}
    assert drift(live, desired) == [
        f"image old:1 -> {desired['spec']['containers'][0]['image']}",
        "flag added --trust-remote-code",
        "flag removed --log-level",
        "env added MC_TE_METRIC=true",
        "container.livenessProbe changed",
    ]
    assert differences(
        {"image": "a", "args": ["--x", "1"], "env": {}}, {"image": "a", "args": ["--x=2"], "env": {}}
    ) == ["flag --x: '1' -> '2'"]
