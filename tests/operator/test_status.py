"""Gang-semantics status from pods (pure, plain equality)."""

from __future__ import annotations

from typing import Any

import pytest

from tandem_operator.api.common import Condition, ConditionStatus
from tandem_operator.api.pdcluster import Phase, RoleStatus
from tandem_operator.decide.observe import GroupState, GroupView, PodHealth, group_views, pod_health
from tandem_operator.decide.status import Recovery, cluster_status, pool_status, role_status

NOW = "2026-11-01T00:00:10Z"
EARLIER = "2026-11-01T00:00:00Z"


def pod(
    group: int,
    rank: int,
    health: str = "ready",
    template: str = "h1",
    node: str = "n1",
) -> dict[str, Any]:
    status: dict[str, Any] = {"phase": "Running", "conditions": [{"type": "Ready", "status": "True"}]}
    metadata: dict[str, Any] = {
        "name": f"kimi-decode-{group}-{rank}",
        "labels": {"tandem.dev/group": str(group), "tandem.dev/rank": str(rank), "tandem.dev/template-hash": template},
    }
    if health == "starting":
        status = {"phase": "Pending"}
    elif health == "notready":
        status["conditions"] = [{"type": "Ready", "status": "False"}]
    elif health == "failed":
        status["phase"] = "Failed"
    elif health == "deleting":
        metadata["deletionTimestamp"] = EARLIER
    elif health == "restarted":
        status["containerStatuses"] = [{"name": "sglang", "restartCount": 1, "state": {"running": {}}}]
    return {"metadata": metadata, "spec": {"nodeName": node}, "status": status}


@pytest.mark.parametrize(
    ("health", "expected"),
    [
        ("ready", PodHealth.READY),
        ("starting", PodHealth.STARTING),
        ("notready", PodHealth.STARTING),
        ("failed", PodHealth.DEAD),
        ("deleting", PodHealth.DEAD),
        ("restarted", PodHealth.DEAD),
    ],
)
def test_pod_health(health: str, expected: PodHealth) -> None:
    assert pod_health(pod(0, 0, health)) == expected


def test_pod_on_a_lost_node_is_dead() -> None:
    assert pod_health(pod(0, 0, node="gone"), lost_nodes=frozenset({"gone"})) == PodHealth.DEAD


@pytest.mark.parametrize(
    ("pods", "state"),
    [
        ([pod(0, 0), pod(0, 1)], GroupState.READY),
        ([pod(0, 0), pod(0, 1, "starting")], GroupState.STARTING),
        ([pod(0, 0, "starting")], GroupState.INCOMPLETE),
        ([pod(0, 0)], GroupState.BROKEN),  # rank 1 vanished from a formed group
        ([pod(0, 0), pod(0, 1, "failed")], GroupState.BROKEN),
        ([pod(0, 0, "starting"), pod(0, 1, "deleting")], GroupState.BROKEN),
        ([pod(0, 0), pod(0, 1, "restarted")], GroupState.BROKEN),
    ],
)
def test_group_state(pods: list[dict[str, Any]], state: GroupState) -> None:
    assert group_views(pods, nodes_per_group=2)[0].state == state


def test_group_views_collects_groups_and_hashes() -> None:
    pods = [pod(0, 0), pod(0, 1), pod(1, 0, template="h2"), pod(1, 1, template="h1"), {"metadata": {"name": "other"}}]
    assert group_views(pods, nodes_per_group=2) == {
        0: GroupView(0, GroupState.READY, "h1", ("kimi-decode-0-0", "kimi-decode-0-1")),
        1: GroupView(1, GroupState.READY, "", ("kimi-decode-1-0", "kimi-decode-1-1")),
    }


def test_role_status_counts() -> None:
    views = {
        0: GroupView(0, GroupState.READY, "h1", ()),
        1: GroupView(1, GroupState.READY, "h0", ()),
        2: GroupView(2, GroupState.BROKEN, "h1", ()),
        3: GroupView(3, GroupState.STARTING, "h1", ()),
    }
    assert role_status(views, desired=4, template_hash="h1") == RoleStatus(
        groups=4, ready_groups=2, updated_groups=2, recovering_groups=1, template_hash="h1"
    )


def role(groups: int, ready: int, updated: int | None = None, recovering: int = 0) -> RoleStatus:
    updated = ready if updated is None else updated
    return RoleStatus(
        groups=groups, ready_groups=ready, updated_groups=updated, recovering_groups=recovering, template_hash="h"
    )


@pytest.mark.parametrize(
    ("prefill", "decode", "phase", "ready", "progressing", "degraded"),
    [
        (role(2, 0, 0), role(1, 0, 0), Phase.PENDING, False, True, False),
        (role(2, 1, 2), role(1, 0, 1), Phase.PROGRESSING, False, True, False),
        (role(2, 2), role(1, 1), Phase.READY, True, False, False),
        (role(2, 1, 1, recovering=1), role(1, 1), Phase.DEGRADED, True, True, True),
        (role(2, 2, 1), role(1, 1), Phase.PROGRESSING, True, True, False),
    ],
)
def test_cluster_status_phase_and_conditions(
    prefill: RoleStatus, decode: RoleStatus, phase: Phase, ready: bool, progressing: bool, degraded: bool
) -> None:
    status = cluster_status(
        generation=3, revision="r", prefill=prefill, decode=decode, recovery=Recovery(), previous=(), now=NOW
    )
    assert status.phase == phase
    assert status.observed_generation == 3
    flags = {c.type: c.status == ConditionStatus.TRUE for c in status.conditions}
    assert flags == {"Ready": ready, "Progressing": progressing, "Degraded": degraded}


def test_condition_transition_time_kept_while_status_unchanged() -> None:
    kept = Condition(type="Ready", status=ConditionStatus.TRUE, reason="Serving", last_transition_time=EARLIER)
    flipped = Condition(type="Degraded", status=ConditionStatus.TRUE, reason="X", last_transition_time=EARLIER)
    status = cluster_status(
        generation=1,
        revision="r",
        prefill=role(1, 1),
        decode=role(1, 1),
        recovery=Recovery(count=2, last_seconds=4.5),
        previous=(kept, flipped),
        now=NOW,
    )
    times = {c.type: c.last_transition_time for c in status.conditions}
    assert times == {"Ready": EARLIER, "Progressing": NOW, "Degraded": NOW}
    assert (status.recoveries, status.last_recovery_seconds) == (2, 4.5)


def test_pool_status() -> None:
    status = pool_status(5, role(3, 2, 3), existing=3, label_selector="a=b", previous=(), now=NOW)
    assert (status.replicas, status.ready_replicas, status.updated_replicas) == (3, 2, 3)
    assert status.label_selector == "a=b"
    assert [(c.type, c.status) for c in status.conditions] == [("Ready", ConditionStatus.FALSE)]
