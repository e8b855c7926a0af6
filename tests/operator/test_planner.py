"""The group planner: a table of (desired, observed groups, template) -> actions."""

from __future__ import annotations

import pytest

from tandem_operator.decide.observe import GroupState, GroupView
from tandem_operator.decide.planner import Action, CreateGroup, DeleteGroup, DeleteReason, plan

R, S, INC, B = GroupState.READY, GroupState.STARTING, GroupState.INCOMPLETE, GroupState.BROKEN
NEW, OLD = "new", "old"


def groups(*specs: tuple[int, GroupState, str]) -> dict[int, GroupView]:
    return {i: GroupView(i, state, template, ()) for i, state, template in specs}


def delete(index: int, reason: DeleteReason) -> DeleteGroup:
    return DeleteGroup(index, reason)


CASES: list[tuple[str, int, dict[int, GroupView], int, list[Action]]] = [
    ("create from nothing", 3, groups(), 1, [CreateGroup(0), CreateGroup(1), CreateGroup(2)]),
    ("steady state", 2, groups((0, R, NEW), (1, R, NEW)), 1, []),
    ("starting groups are left alone", 2, groups((0, R, NEW), (1, S, NEW)), 1, []),
    ("fill the lowest free index", 3, groups((0, R, NEW), (2, R, NEW)), 1, [CreateGroup(1)]),
    ("incomplete group gets its missing pods", 2, groups((0, R, NEW), (1, INC, NEW)), 1, [CreateGroup(1)]),
    (
        "scale down removes the highest index",
        1,
        groups((0, R, NEW), (1, R, NEW), (2, R, NEW)),
        1,
        [delete(2, DeleteReason.SCALE_DOWN), delete(1, DeleteReason.SCALE_DOWN)],
    ),
    (
        "scale down prefers not-ready groups",
        2,
        groups((0, S, NEW), (1, R, NEW), (2, R, NEW)),
        1,
        [delete(0, DeleteReason.SCALE_DOWN)],
    ),
    ("scale to zero", 0, groups((0, R, NEW)), 0, [delete(0, DeleteReason.SCALE_DOWN)]),
    (
        "a broken group is deleted whole and keeps its index",
        2,
        groups((0, R, NEW), (1, B, NEW)),
        1,
        [delete(1, DeleteReason.BROKEN)],
    ),
    ("recreated under the same name once gone", 2, groups((0, R, NEW)), 1, [CreateGroup(1)]),
    (
        "scale down takes broken groups first",
        1,
        groups((0, R, NEW), (1, B, NEW)),
        1,
        [delete(1, DeleteReason.SCALE_DOWN)],
    ),
    # Rollout with a surge group.
    ("roll: surge one new group", 2, groups((0, R, OLD), (1, R, OLD)), 1, [CreateGroup(2)]),
    ("roll: wait for the surge group", 2, groups((0, R, OLD), (1, R, OLD), (2, S, NEW)), 1, []),
    (
        "roll: surge ready -> retire one old group and surge the next",
        2,
        groups((0, R, OLD), (1, R, OLD), (2, R, NEW)),
        1,
        [delete(1, DeleteReason.ROLLOUT), CreateGroup(3)],
    ),
    (
        "roll: old group terminating counts as surplus",
        2,
        groups((0, R, OLD), (1, B, OLD), (2, R, NEW), (3, S, NEW)),
        1,
        [delete(1, DeleteReason.SCALE_DOWN)],
    ),
    (
        "roll: last old group retires",
        2,
        groups((0, R, OLD), (2, R, NEW), (3, R, NEW)),
        1,
        [delete(0, DeleteReason.ROLLOUT)],
    ),
    (
        "roll: outdated groups that do not serve are replaced at once (plus the surge group)",
        2,
        groups((0, S, OLD), (1, R, OLD)),
        1,
        [delete(0, DeleteReason.ROLLOUT), CreateGroup(2), CreateGroup(3)],
    ),
    # Rollout in place (no spare nodes): the replacement takes the retired group's index (and next epoch) once its
    # pods are gone, on the nodes they free.
    (
        "in place: retire one old group when all are ready",
        2,
        groups((0, R, OLD), (1, R, OLD)),
        0,
        [delete(1, DeleteReason.ROLLOUT)],
    ),
    ("in place: recreate it under its index once gone", 2, groups((0, R, OLD)), 0, [CreateGroup(1)]),
    ("in place: wait while a group is not ready", 2, groups((0, R, OLD), (1, S, NEW)), 0, []),
    (
        "in place: next step",
        2,
        groups((0, R, OLD), (1, R, NEW)),
        0,
        [delete(0, DeleteReason.ROLLOUT)],
    ),
    (
        "a half-rolled group (mixed hashes) is outdated",
        1,
        groups((0, R, "")),
        1,
        [CreateGroup(1)],
    ),
]


@pytest.mark.parametrize(
    ("desired", "observed", "max_surge", "expected"), [c[1:] for c in CASES], ids=[c[0] for c in CASES]
)
def test_plan(desired: int, observed: dict[int, GroupView], max_surge: int, expected: list[Action]) -> None:
    assert plan(desired, observed, NEW, max_surge) == expected


def test_rollout_converges_and_never_drops_below_desired_ready_groups() -> None:
    """Drive the planner against a toy world: a deleted group vanishes, a created one is Ready one step later."""
    world = groups((0, R, OLD), (1, R, OLD), (2, R, OLD))
    for _ in range(20):
        actions = plan(3, world, NEW, 1)
        if not actions and all(g.state is R for g in world.values()):
            break
        nxt = {i: GroupView(i, R, g.template_hash, ()) for i, g in world.items()}
        for action in actions:
            if isinstance(action, DeleteGroup):
                nxt.pop(action.index)
            else:
                nxt[action.index] = GroupView(action.index, S, NEW, ())
        assert sum(g.state is R for g in nxt.values()) >= 3, nxt
        assert len(nxt) <= 4, nxt
        world = nxt
    assert sorted(g.template_hash for g in world.values()) == [NEW, NEW, NEW]


def test_the_last_ready_group_of_an_old_revision_waits_for_the_other_roles_new_revision() -> None:
    views = {
        0: GroupView(0, R, OLD, (), revision="rev-old"),
        1: GroupView(1, R, NEW, (), revision="rev-new"),
    }
    # No registered pair of the new revision yet: routers would have no pair without group 0.
    assert plan(1, views, NEW, 1, revisions=("rev-new", frozenset({"rev-old"}))) == []
    assert plan(1, views, NEW, 1, revisions=("rev-new", frozenset({"rev-old", "rev-new"}))) == [
        delete(0, DeleteReason.ROLLOUT)
    ]
    # A template change that keeps the revision (e.g. an env var) pairs as before: no wait.
    same = {0: GroupView(0, R, OLD, (), revision="rev"), 1: GroupView(1, R, NEW, (), revision="rev")}
    assert plan(1, same, NEW, 1, revisions=("rev", frozenset({"rev"}))) == [delete(0, DeleteReason.ROLLOUT)]


def test_a_draining_group_stays_the_scale_down_victim() -> None:
    views = groups((0, S, NEW), (1, R, NEW), (2, R, NEW))
    assert plan(2, views, NEW, 1) == [delete(0, DeleteReason.SCALE_DOWN)]
    assert plan(2, views, NEW, 1, retiring=frozenset({2})) == [delete(2, DeleteReason.SCALE_DOWN)]
