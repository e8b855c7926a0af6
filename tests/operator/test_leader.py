"""Lease-based leader election decisions (pure, time passed in)."""

from __future__ import annotations

import copy
from collections.abc import Callable
from dataclasses import dataclass
from datetime import UTC, datetime, timedelta
from typing import Any

import pytest

from tandem_operator.act.k8s.election import LeaderElector
from tandem_operator.act.k8s.kube import ConflictError
from tandem_operator.decide.leader import LeaseAction, LeaseState, decide, lease_body, lease_state, observe

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
        (lease("other", 5, duration=30), LeaseAction.WAIT),
        (lease("other", 5), LeaseAction.ACQUIRE),
        (lease("other", 3600), LeaseAction.ACQUIRE),
        (lease(None, 1), LeaseAction.ACQUIRE),
    ],
)
def test_decide(body: dict[str, object] | None, action: LeaseAction) -> None:
    """Expiry is judged from when this replica saw the record (here 16 s of its own clock later), never from the
    holder's renewTime: a record renewed "20 s ago" and one renewed "5 s ago" are the same if first seen now."""
    seen = observe(None, lease_state(body), 100.0)
    assert decide(seen, "me", 100.0 + 16) is action
    if action is LeaseAction.ACQUIRE and body is not None and body["spec"]["holderIdentity"] == "other":  # type: ignore[index]
        assert decide(seen, "me", 100.0 + 14) is LeaseAction.WAIT  # first seen 14 s ago: the holder may be alive


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


def _renewed(body: dict[str, object], seconds: float) -> dict[str, object]:
    spec = dict(body["spec"])  # type: ignore[call-overload]
    renew = datetime.fromisoformat(str(spec["renewTime"]).replace("Z", "+00:00")) + timedelta(seconds=seconds)
    spec["renewTime"] = renew.strftime("%Y-%m-%dT%H:%M:%S.%fZ")
    return {**body, "spec": spec}


def test_expiry_counts_from_the_last_change_this_replica_saw() -> None:
    """The holder's renewTime says nothing to the standby (it was written with another clock): while the record
    keeps changing the standby waits; it takes over ``duration`` after the last change it saw."""
    body = lease("other", 3600, duration=6)  # an hour old by this test's wall clock: irrelevant
    seen = observe(None, lease_state(body), 0.0)
    for t in range(2, 20, 2):  # the holder renews every 2 s; the standby reads it every 2 s
        body = _renewed(body, 2)
        seen = observe(seen, lease_state(body), float(t))
        assert decide(seen, "me", float(t)) is LeaseAction.WAIT
    for later in (20.0, 22.0, 24.0):  # the holder died after its renewal at t=18: the record stops changing
        seen = observe(seen, lease_state(body), later)
        assert decide(seen, "me", later) is LeaseAction.WAIT
    seen = observe(seen, lease_state(body), 24.5)
    assert decide(seen, "me", 24.5) is LeaseAction.ACQUIRE


def test_an_unchanged_record_keeps_its_first_sighting_and_a_new_resource_version() -> None:
    first = lease_state(lease("other", 0))
    later = lease_state({**lease("other", 0), "metadata": {"name": "tandem-operator", "resourceVersion": "43"}})
    seen = observe(observe(None, first, 1.0), later, 5.0)
    assert seen is not None
    assert (seen.at, seen.state.resource_version) == (1.0, "43")
    assert observe(seen, None, 6.0) is None


class LeaseServer:
    """A Lease endpoint with the API server's optimistic concurrency (resourceVersion), for the election adapter."""

    def __init__(self) -> None:
        self.lease: dict[str, Any] | None = None
        self.version = 0

    async def get(self, path: str) -> dict[str, Any] | None:
        return copy.deepcopy(self.lease)

    async def post(self, path: str, body: dict[str, Any]) -> dict[str, Any]:
        if self.lease is not None:
            raise ConflictError(409, "Conflict", path)
        return self._store(body)

    async def put(self, path: str, body: dict[str, Any]) -> dict[str, Any]:
        assert self.lease is not None
        if body["metadata"].get("resourceVersion") != self.lease["metadata"]["resourceVersion"]:
            raise ConflictError(409, "Conflict", path)
        return self._store(body)

    def _store(self, body: dict[str, Any]) -> dict[str, Any]:
        self.version += 1
        self.lease = copy.deepcopy(body)
        self.lease["metadata"]["resourceVersion"] = str(self.version)
        return copy.deepcopy(self.lease)


@dataclass
class Clock:
    t: float = 0.0

    def __call__(self) -> float:
        return self.t


async def test_elector_with_a_skewed_wall_clock_waits_for_a_live_holder_and_takes_over_a_dead_one() -> None:
    server, clock = LeaseServer(), Clock()

    def wall(skew: timedelta) -> Callable[[], datetime]:
        return lambda: NOW + skew + timedelta(seconds=clock.t)

    holder = LeaderElector(
        server, name="l", namespace="ops", identity="a", duration_s=6, clock=clock,  # type: ignore[arg-type]
        wall_clock=wall(timedelta(0)),
    )  # fmt: skip
    standby = LeaderElector(  # an hour ahead: the holder's renewTime always looks an hour old to it
        server, name="l", namespace="ops", identity="b", duration_s=6, clock=clock,  # type: ignore[arg-type]
        wall_clock=wall(timedelta(hours=1)),
    )  # fmt: skip
    assert await holder.try_once()
    for _ in range(10):  # the holder renews every 2 s
        clock.t += 2
        assert await holder.try_once()
        assert not await standby.try_once()
    clock.t += 6  # the holder is gone: no renewal for the Lease's duration, on the standby's own clock
    assert not await standby.try_once()  # first sighting of the last record was 6 s ago: not yet past it
    clock.t += 0.5
    assert await standby.try_once()
    assert server.lease is not None
    assert server.lease["spec"]["holderIdentity"] == "b"
    assert server.lease["spec"]["leaseTransitions"] == 1
