"""Group incarnations (epochs) and fences applied to observed groups. Pure.

A group's epoch is stamped on its Service and on every pod (``tandem.dev/epoch``). Before the operator deletes a
group to recreate it (a member died, or a rollout), it bumps the Service's epoch; the replacement pods are created
with the Service's epoch. So the epoch survives an operator restart, and a router can tell incarnations apart.

A fence is recorded on the group's Service too (``tandem.dev/fenced: "<epoch>/<reason>"``): a group fenced while
NotReady looks merely "starting" to a fresh operator, so without the record a restart would leave it half-dead.
"""

from __future__ import annotations

import copy
from collections.abc import Iterable, Mapping
from dataclasses import dataclass, replace
from datetime import datetime, timedelta
from typing import Any

from tandem.registry import Role
from tandem_operator.decide.observe import (
    GroupKey,
    GroupState,
    GroupView,
    Pod,
    PrefetchState,
    created_at,
    pod_facts,
    prefetch,
    started,
)
from tandem_operator.desired.naming import (
    ANNOTATION_EPOCH,
    ANNOTATION_FENCED,
    ANNOTATION_PEER_LOAD_FAILED,
    LABEL_GROUP,
    LABEL_ROLE,
)


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


def _service_annotations(services: Iterable[Mapping[str, Any]], name: str) -> dict[GroupKey, str]:
    found: dict[GroupKey, str] = {}
    for service in services:
        metadata = service.get("metadata") or {}
        labels, annotations = metadata.get("labels") or {}, metadata.get("annotations") or {}
        raw_role, raw_group = labels.get(LABEL_ROLE), labels.get(LABEL_GROUP, "")
        if raw_role in {r.value for r in Role} and raw_group.isdigit() and name in annotations:
            found[GroupKey(Role(raw_role), int(raw_group))] = str(annotations[name])
    return found


def service_epochs(services: Iterable[Mapping[str, Any]]) -> dict[GroupKey, int]:
    """The epoch recorded on each group's Service (Services without the annotation are left out)."""
    raw = _service_annotations(services, ANNOTATION_EPOCH)
    return {key: int(value) for key, value in raw.items() if value.isdigit()}


def fence_annotation(epoch: int, reason: str, peer_load_failed: bool = False) -> dict[str, Any]:
    """The merge patch that records a fence on the group's Service (and, when the incarnation died loading its
    weights from a peer, that its successor loads from the node: ``desired.seeding``)."""
    annotations = {ANNOTATION_FENCED: f"{epoch}/{reason}"}
    if peer_load_failed:
        annotations[ANNOTATION_PEER_LOAD_FAILED] = str(epoch)
    return {"metadata": {"annotations": annotations}}


def service_peer_load_failures(services: Iterable[Mapping[str, Any]]) -> dict[GroupKey, int]:
    """The epoch of each group's last incarnation that died loading from a peer, as recorded on its Service."""
    raw = _service_annotations(services, ANNOTATION_PEER_LOAD_FAILED)
    return {key: int(value) for key, value in raw.items() if value.isdigit()}


def service_fences(services: Iterable[Mapping[str, Any]]) -> dict[GroupKey, tuple[int, str]]:
    """(epoch, reason) of the last fenced incarnation of each group, as recorded on its Service."""
    fences: dict[GroupKey, tuple[int, str]] = {}
    for key, value in _service_annotations(services, ANNOTATION_FENCED).items():
        epoch, _, reason = value.partition("/")
        if epoch.isdigit():
            fences[key] = (int(epoch), reason)
    return fences


def resumed_fences(
    recorded: Mapping[GroupKey, tuple[int, str]], known: Mapping[GroupKey, object], pod_epochs: Mapping[GroupKey, int]
) -> dict[GroupKey, tuple[int, str]]:
    """Recorded fences a fresh runtime does not know yet whose incarnation still has pods: recreate those."""
    return {
        key: (epoch, reason)
        for key, (epoch, reason) in recorded.items()
        if key not in known and pod_epochs.get(key) == epoch
    }


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


@dataclass(frozen=True)
class Stuck:
    """A group past its deadline: the member that kept it from starting, and whether that member was still
    staging its weights (``lifecycle.weightDownloadDeadlineSeconds`` ran out, not ``startDeadlineSeconds``)."""

    pod: str
    downloading: bool = False


def _due(pod: Pod, start_s: float, download_s: float) -> datetime | None:
    """When this member's time runs out: ``start_s`` after its prefetch finished (or, without one or before it
    ran, after its creation); ``download_s`` after its creation while the prefetch runs."""
    created, fetch = created_at(pod), prefetch(pod)
    if fetch.state is PrefetchState.RUNNING:
        return None if created is None else created + timedelta(seconds=download_s)
    since = (fetch.finished_at or created) if fetch.state is PrefetchState.DONE else created
    return None if since is None else since + timedelta(seconds=start_s)


def stuck_groups(
    role: Role,
    views: Mapping[int, GroupView],
    pods: Mapping[str, Pod],
    now: datetime,
    deadline_s: float,
    download_deadline_s: float,
) -> dict[GroupKey, Stuck]:
    """Groups stuck Starting or Incomplete past their deadline -> the member that kept them.

    A member's time runs out ``deadline_s`` (``lifecycle.startDeadlineSeconds``) after its weight prefetch finished,
    or after its creation when it has none or has not run it yet (unschedulable, pulling); while the prefetch runs
    (downloading, or restarted after a failure), ``download_deadline_s`` (``weightDownloadDeadlineSeconds``) after
    its creation. The group is stuck once its newest member's time ran out. A STARTING group whose members have
    all started (their startupProbe passed) is a loaded group that is merely NotReady (busy): readiness only
    takes it out of rotation and liveness decides about it, so it is never stuck. An INCOMPLETE group (a rank
    missing, e.g. unschedulable) or one with a member not started (Pending, pulling, downloading, loading) is; the
    kubelet's startupProbe already bounds a load, so this catches what no probe sees.
    """
    result: dict[GroupKey, Stuck] = {}
    for index, view in views.items():
        if view.state not in (GroupState.STARTING, GroupState.INCOMPLETE):
            continue
        members = [pods[name] for name in view.pods if name in pods]
        if view.state is GroupState.STARTING and all(started(p) for p in members):
            continue
        dues = [t for t in (_due(p, deadline_s, download_deadline_s) for p in members) if t is not None]
        if not dues or now <= max(dues):
            continue
        downloading = [p for p in members if prefetch(p).state is PrefetchState.RUNNING]
        waiting = next(iter(downloading), next((p for p in members if not started(p)), members[0]))
        result[GroupKey(role, index)] = Stuck(str(waiting["metadata"]["name"]), bool(downloading))
    return result
