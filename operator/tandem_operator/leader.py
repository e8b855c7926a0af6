"""Leader election over a ``coordination.k8s.io/v1`` Lease: the pure decision. Time is passed in.

Only the holder of the Lease runs handlers; other replicas wait. The holder renews every ``duration / 3``; a
replica takes over when the holder has not renewed for ``duration`` seconds (``renewTime + leaseDurationSeconds``
in the past), bumping ``leaseTransitions``. Writes use the Lease's ``resourceVersion`` (optimistic concurrency),
so two replicas racing for an expired Lease cannot both win. A holder that fails to renew before its Lease
expires stops itself (exit code 1): a deposed leader must never keep writing.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass
from datetime import UTC, datetime, timedelta
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


def decide(state: LeaseState | None, me: str, now: datetime) -> LeaseAction:
    if state is None:
        return LeaseAction.CREATE
    if state.holder == me:
        return LeaseAction.RENEW
    if state.holder is None or state.renew_time is None:
        return LeaseAction.ACQUIRE
    if state.renew_time + timedelta(seconds=state.duration_s) < now:
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
