"""Group incarnations (epochs) and fences applied to observed groups. Pure.

A group's epoch is stamped on its Service and on every pod (``tandem.dev/epoch``). Before the operator deletes a
group to recreate it (a member died, or a rollout), it bumps the Service's epoch; the replacement pods are created
with the Service's epoch. So the epoch survives an operator restart, and a router can tell incarnations apart.
"""

from __future__ import annotations

import copy
from collections.abc import Iterable, Mapping
from dataclasses import dataclass, replace
from typing import Any

from tandem.registry import Role
from tandem_operator.desired.naming import ANNOTATION_EPOCH, LABEL_GROUP, LABEL_ROLE
from tandem_operator.fencing import GroupKey, Pod, pod_facts
from tandem_operator.status import GroupState, GroupView


def stamp_epoch(manifest: Mapping[str, Any], epoch: int) -> dict[str, Any]:
    """A copy of a pod or Service manifest annotated with the group's epoch."""
    stamped = copy.deepcopy(dict(manifest))
    annotations = stamped["metadata"].setdefault("annotations", {})
    annotations[ANNOTATION_EPOCH] = str(epoch)
    return stamped


def group_epochs(pods: Iterable[Pod]) -> dict[GroupKey, int]:
    """The highest epoch among each group's pods."""
    epochs: dict[GroupKey, int] = {}
    for pod in pods:
        facts = pod_facts(pod)
        if facts is not None:
            epochs[facts.group] = max(epochs.get(facts.group, 0), facts.epoch)
    return epochs


def service_epochs(services: Iterable[Mapping[str, Any]]) -> dict[GroupKey, int]:
    """The epoch recorded on each group's Service (Services without the annotation are left out)."""
    epochs: dict[GroupKey, int] = {}
    for service in services:
        metadata = service.get("metadata") or {}
        labels, annotations = metadata.get("labels") or {}, metadata.get("annotations") or {}
        raw_role, raw_group, raw_epoch = (
            labels.get(LABEL_ROLE),
            labels.get(LABEL_GROUP, ""),
            annotations.get(ANNOTATION_EPOCH, ""),
        )
        if raw_role in {r.value for r in Role} and raw_group.isdigit() and raw_epoch.isdigit():
            epochs[GroupKey(Role(raw_role), int(raw_group))] = int(raw_epoch)
    return epochs


def apply_fences(
    role: Role, views: Mapping[int, GroupView], fenced: Mapping[GroupKey, int], epochs: Mapping[GroupKey, int]
) -> dict[int, GroupView]:
    """A group fenced at the epoch its pods carry is BROKEN, whatever its pods look like now (a NotReady member
    that came back is still a member of a group routers were told to drop): it is recreated whole."""
    result: dict[int, GroupView] = {}
    for index, view in views.items():
        key = GroupKey(role, index)
        if key in fenced and fenced[key] == epochs.get(key, 0) and view.state is not GroupState.BROKEN:
            view = replace(view, state=GroupState.BROKEN)
        result[index] = view
    return result


@dataclass(frozen=True)
class FenceRecord:
    """A fenced incarnation, kept until the group is registered again (then its duration is a recovery)."""

    epoch: int
    reason: str
    fenced_at: float  # monotonic seconds, when the death was observed


def recovered(
    fenced: Mapping[GroupKey, FenceRecord], registered_epochs: Mapping[GroupKey, int], now: float
) -> dict[GroupKey, float]:
    """Groups whose newer incarnation was just registered -> seconds since the fence."""
    return {
        key: now - record.fenced_at
        for key, record in fenced.items()
        if key in registered_epochs and registered_epochs[key] > record.epoch
    }
