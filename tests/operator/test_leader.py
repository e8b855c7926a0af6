"""Lease-based leader election decisions (pure, time passed in)."""

from __future__ import annotations

from datetime import UTC, datetime, timedelta

import pytest

from tandem_operator.leader import LeaseAction, LeaseState, decide, lease_body, lease_state

NOW = datetime(2026, 11, 1, 12, 0, 0, tzinfo=UTC)


def lease(holder: str | None, renewed_ago: float, duration: int = 15) -> dict[str, object]:
    renew = (NOW - timedelta(seconds=renewed_ago)).strftime("%Y-%m-%dT%H:%M:%S.%fZ")
    return {
        "metadata": {"name": "tandem-operator", "resourceVersion": "42"},
        "spec": {"holderIdentity": holder, "renewTime": renew, "leaseDurationSeconds": duration, "leaseTransitions": 3},
    }


@pytest.mark.parametrize(
    ("body", "action"),
    [
        (None, LeaseAction.CREATE),
        (lease("me", 20), LeaseAction.RENEW),  # even late: nobody took it over yet
        (lease("other", 5), LeaseAction.WAIT),
        (lease("other", 16), LeaseAction.ACQUIRE),
        (lease(None, 1), LeaseAction.ACQUIRE),
    ],
)
def test_decide(body: dict[str, object] | None, action: LeaseAction) -> None:
    assert decide(lease_state(body), "me", NOW) is action


def test_acquire_bumps_transitions_and_carries_the_resource_version() -> None:
    state = lease_state(lease("other", 30))
    body = lease_body(
        name="tandem-operator",
        namespace="ops",
        me="me",
        duration_s=15,
        now=NOW,
        action=LeaseAction.ACQUIRE,
        state=state,
    )
    assert body["metadata"] == {"name": "tandem-operator", "namespace": "ops", "resourceVersion": "42"}
    assert body["spec"] == {
        "holderIdentity": "me",
        "leaseDurationSeconds": 15,
        "renewTime": "2026-11-01T12:00:00.000000Z",
        "acquireTime": "2026-11-01T12:00:00.000000Z",
        "leaseTransitions": 4,
    }


def test_renew_keeps_acquire_time_and_transitions() -> None:
    state = LeaseState("me", NOW, 15, 3, "7", acquire_time=NOW - timedelta(hours=1))
    later = NOW + timedelta(seconds=5)
    body = lease_body(
        name="l", namespace="ops", me="me", duration_s=15, now=later, action=LeaseAction.RENEW, state=state
    )
    assert body["spec"]["leaseTransitions"] == 3
    assert body["spec"]["acquireTime"] == "2026-11-01T11:00:00.000000Z"
    assert body["spec"]["renewTime"] == "2026-11-01T12:00:05.000000Z"


def test_create_and_wait() -> None:
    body = lease_body(name="l", namespace="ops", me="me", duration_s=15, now=NOW, action=LeaseAction.CREATE, state=None)
    assert "resourceVersion" not in body["metadata"]
    assert body["spec"]["leaseTransitions"] == 0
    with pytest.raises(ValueError, match="another replica"):
        lease_body(name="l", namespace="ops", me="me", duration_s=15, now=NOW, action=LeaseAction.WAIT, state=None)
