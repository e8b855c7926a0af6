"""Kubernetes Events (events.k8s.io/v1) for each recovery and scaling step. Pure: time is passed in."""

from __future__ import annotations

from dataclasses import dataclass
from datetime import UTC, datetime
from typing import Any

from tandem_operator.decide.reasons import EventType, Reason

REPORTING_CONTROLLER = "tandem.dev/operator"
MAX_NOTE = 1024  # the API server rejects longer notes


@dataclass(frozen=True)
class Regarding:
    """The object an event is about."""

    api_version: str
    kind: str
    name: str
    namespace: str
    uid: str


def event_manifest(
    regarding: Regarding,
    *,
    reason: Reason,
    note: str,
    action: str,
    now: datetime,
    instance: str,
    type_: EventType = EventType.NORMAL,
) -> dict[str, Any]:
    """An Event body; its name is unique per (object, nanosecond) so two events never collide."""
    if now.tzinfo is None:
        raise ValueError("now must be timezone-aware")
    stamp = int(now.timestamp() * 1_000_000_000)
    return {
        "apiVersion": "events.k8s.io/v1",
        "kind": "Event",
        "metadata": {"name": f"{regarding.name}.{stamp:x}", "namespace": regarding.namespace},
        "eventTime": now.astimezone(UTC).strftime("%Y-%m-%dT%H:%M:%S.%fZ"),  # MicroTime
        "reportingController": REPORTING_CONTROLLER,
        "reportingInstance": instance,
        "action": action,
        "reason": reason.value,
        "type": type_.value,
        "note": note if len(note) <= MAX_NOTE else note[: MAX_NOTE - 3] + "...",
        "regarding": {
            "apiVersion": regarding.api_version,
            "kind": regarding.kind,
            "name": regarding.name,
            "namespace": regarding.namespace,
            "uid": regarding.uid,
        },
    }
