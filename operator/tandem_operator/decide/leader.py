"""Leader election over a ``coordination.k8s.io/v1`` Lease: the pure decision. Time is passed in.

Only the holder of the Lease runs handlers; other replicas wait. The holder renews every ``duration / 3``; a
replica takes over when the holder has not renewed for ``duration`` seconds, bumping ``leaseTransitions``.
"Not renewed" is judged on this replica's own monotonic clock, from when it last saw the record change
(``observe``), as client-go does (``LeaderElector.tryAcquireOrRenew``: ``observedTime + LeaseDuration``), never by
comparing the holder's ``renewTime`` with the local wall clock: with skewed clocks that would take a live holder's
Lease (standby ahead) or wait far too long for a dead one (standby behind). ``renewTime`` is still written, for
people and tools. Writes use the Lease's ``resourceVersion`` (optimistic concurrency),
so two replicas racing for an expired Lease cannot both win. A holder that fails to renew before its Lease
expires stops itself (exit code 1): a deposed leader must never keep writing.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass
from datetime import UTC, datetime
from enum import StrEnum
from typing import Any


class LeaseAction(StrEnum):
    CREATE = "Create"  # no Lease yet
    ACQUIRE = "Acquire"  # someone else's Lease expired (or it was released): take it over
    RENEW = "Renew"  # we hold it
    WAIT = "Wait"  # someone else holds a valid Lease


@dataclass(frozen=True)
class LeaseState:
    holder: str | None
    renew_time: datetime | None
    duration_s: int
    transitions: int
    resource_version: str | None
    acquire_time: datetime | None = None


def _parse_time(value: object) -> datetime | None:
    if not isinstance(value, str) or not value:
        return None
    return datetime.fromisoformat(value.replace("Z", "+00:00"))


def lease_state(lease: Mapping[str, Any] | None) -> LeaseState | None:
    if lease is None:
        return None
    spec = lease.get("spec") or {}
    return LeaseState(
        holder=spec.get("holderIdentity") or None,
        renew_time=_parse_time(spec.get("renewTime")),
        duration_s=int(spec.get("leaseDurationSeconds") or 0),
        transitions=int(spec.get("leaseTransitions") or 0),
        resource_version=(lease.get("metadata") or {}).get("resourceVersion"),
        acquire_time=_parse_time(spec.get("acquireTime")),
    )


@dataclass(frozen=True)
class Observed:
    """The Lease as this replica last saw it change, and when: ``at`` is on this replica's monotonic clock."""

    state: LeaseState
    at: float


def _record(state: LeaseState) -> tuple[object, ...]:
    """What the holder writes (client-go compares the whole LeaderElectionRecord); not the resourceVersion."""
    return state.holder, state.renew_time, state.acquire_time, state.transitions, state.duration_s


def observe(previous: Observed | None, state: LeaseState | None, now: float) -> Observed | None:
    """The new observation after reading ``state`` at local monotonic time ``now``: unchanged record, same time."""
    if state is None:
        return None
    if previous is not None and _record(previous.state) == _record(state):
        return Observed(state, previous.at)  # the newest resourceVersion, the time of the last change
    return Observed(state, now)


def decide(observed: Observed | None, me: str, now: float) -> LeaseAction:
    """``now`` is this replica's monotonic clock, the one ``observed.at`` was read from."""
    if observed is None:
        return LeaseAction.CREATE
    state = observed.state
    if state.holder == me:
        return LeaseAction.RENEW
    if state.holder is None or state.renew_time is None:
        return LeaseAction.ACQUIRE
    if observed.at + state.duration_s < now:
        return LeaseAction.ACQUIRE
    return LeaseAction.WAIT


def _micro_time(now: datetime) -> str:
    return now.astimezone(UTC).strftime("%Y-%m-%dT%H:%M:%S.%fZ")


def lease_body(
    *,
    name: str,
    namespace: str,
    me: str,
    duration_s: int,
    now: datetime,
    action: LeaseAction,
    state: LeaseState | None,
) -> dict[str, Any]:
    """The Lease to write for ``action`` (CREATE, ACQUIRE or RENEW), carrying the resourceVersion it replaces."""
    if action is LeaseAction.WAIT:
        raise ValueError("nothing to write while another replica holds the lease")
    taking_over = action is LeaseAction.ACQUIRE
    transitions = 0 if state is None else state.transitions + (1 if taking_over else 0)
    acquired = now if state is None or taking_over else state.acquire_time
    spec: dict[str, Any] = {
        "holderIdentity": me,
        "leaseDurationSeconds": duration_s,
        "renewTime": _micro_time(now),
        "leaseTransitions": transitions,
    }
    if acquired is not None:
        spec["acquireTime"] = _micro_time(acquired)
    metadata: dict[str, Any] = {"name": name, "namespace": namespace}
    if state is not None and state.resource_version is not None:
        metadata["resourceVersion"] = state.resource_version
    return {"apiVersion": "coordination.k8s.io/v1", "kind": "Lease", "metadata": metadata, "spec": spec}
