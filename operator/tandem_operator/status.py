"""Observed state from child pods, with gang semantics. Pure: no I/O, time passed in.

A pod is DEAD when it is being deleted, has terminated (Failed/Succeeded), restarted a container (NCCL lost the
rank even if the kubelet brought it back) or sits on a node the caller knows is lost. A group is:

* READY when every rank is present and Ready;
* BROKEN when any member is dead, or a rank is missing after some member had become Ready (the NCCL group had
  formed and lost a rank): the whole group must be recreated, never left half-alive;
* INCOMPLETE when ranks are missing but none had become Ready yet (still being created: create the rest);
* STARTING otherwise (all present, not all Ready).
"""

from __future__ import annotations

from collections import defaultdict
from collections.abc import Iterable, Mapping
from dataclasses import dataclass
from enum import StrEnum
from typing import Any

from tandem_operator.api.common import Condition, ConditionStatus
from tandem_operator.api.pdcluster import PDClusterStatus, Phase, RoleStatus
from tandem_operator.api.pdpool import PDPoolStatus
from tandem_operator.desired.naming import LABEL_GROUP, LABEL_RANK, LABEL_TEMPLATE_HASH

Pod = Mapping[str, Any]


class PodHealth(StrEnum):
    READY = "Ready"
    STARTING = "Starting"
    DEAD = "Dead"


class GroupState(StrEnum):
    READY = "Ready"
    STARTING = "Starting"
    INCOMPLETE = "Incomplete"
    BROKEN = "Broken"


@dataclass(frozen=True)
class GroupView:
    index: int
    state: GroupState
    template_hash: str  # "" when the ranks disagree (a half-rolled group counts as outdated)
    pods: tuple[str, ...]


def pod_health(pod: Pod, lost_nodes: frozenset[str] = frozenset()) -> PodHealth:
    metadata, status = pod.get("metadata", {}), pod.get("status", {})
    phase = status.get("phase")
    if metadata.get("deletionTimestamp") or phase in ("Failed", "Succeeded"):
        return PodHealth.DEAD
    for container in status.get("containerStatuses", ()):
        if container.get("restartCount", 0) > 0 or "terminated" in container.get("state", {}):
            return PodHealth.DEAD
    if pod.get("spec", {}).get("nodeName") in lost_nodes:
        return PodHealth.DEAD
    ready = any(c.get("type") == "Ready" and c.get("status") == "True" for c in status.get("conditions", ()))
    return PodHealth.READY if phase == "Running" and ready else PodHealth.STARTING


def group_views(
    pods: Iterable[Pod], nodes_per_group: int, lost_nodes: frozenset[str] = frozenset()
) -> dict[int, GroupView]:
    """Pods of one role, grouped by their group label. Pods without tandem labels are ignored."""
    by_group: dict[int, list[Pod]] = defaultdict(list)
    for pod in pods:
        labels = pod.get("metadata", {}).get("labels", {})
        if labels.get(LABEL_GROUP, "").isdigit() and labels.get(LABEL_RANK, "").isdigit():
            by_group[int(labels[LABEL_GROUP])].append(pod)
    return {index: _group_view(index, members, nodes_per_group, lost_nodes) for index, members in by_group.items()}


def _group_view(index: int, pods: list[Pod], nodes_per_group: int, lost_nodes: frozenset[str]) -> GroupView:
    health = [pod_health(pod, lost_nodes) for pod in pods]
    ranks = {int(pod["metadata"]["labels"][LABEL_RANK]) for pod in pods}
    hashes = {pod["metadata"]["labels"].get(LABEL_TEMPLATE_HASH, "") for pod in pods}
    missing = set(range(nodes_per_group)) - ranks
    if PodHealth.DEAD in health or (missing and PodHealth.READY in health):
        state = GroupState.BROKEN
    elif missing:
        state = GroupState.INCOMPLETE
    elif all(h is PodHealth.READY for h in health):
        state = GroupState.READY
    else:
        state = GroupState.STARTING
    names = tuple(sorted(pod["metadata"]["name"] for pod in pods))
    return GroupView(index, state, hashes.pop() if len(hashes) == 1 else "", names)


def role_status(views: Mapping[int, GroupView], desired: int, template_hash: str) -> RoleStatus:
    return RoleStatus(
        groups=desired,
        ready_groups=sum(v.state is GroupState.READY for v in views.values()),
        updated_groups=sum(
            v.template_hash == template_hash and v.state is not GroupState.BROKEN for v in views.values()
        ),
        recovering_groups=sum(v.state is GroupState.BROKEN for v in views.values()),
        template_hash=template_hash,
    )


def pool_status(
    generation: int, role: RoleStatus, existing: int, label_selector: str, previous: Iterable[Condition], now: str
) -> PDPoolStatus:
    ready = role.ready_groups >= role.groups and role.updated_groups >= role.groups and existing == role.groups
    ready_condition = condition(
        "Ready",
        ready,
        "AllGroupsReady" if ready else "GroupsNotReady",
        f"{role.ready_groups}/{role.groups} groups ready, {role.updated_groups} up to date",
        generation,
        previous,
        now,
    )
    return PDPoolStatus(
        observed_generation=generation,
        replicas=existing,
        ready_replicas=role.ready_groups,
        updated_replicas=role.updated_groups,
        label_selector=label_selector,
        template_hash=role.template_hash,
        conditions=[ready_condition],
    )


def condition(
    kind: str, value: bool, reason: str, message: str, generation: int, previous: Iterable[Condition], now: str
) -> Condition:
    """A condition of ``kind``; its transition time is kept from ``previous`` while the status stays the same."""
    status = ConditionStatus.TRUE if value else ConditionStatus.FALSE
    before = next((c for c in previous if c.type == kind), None)
    since = before.last_transition_time if before is not None and before.status is status else now
    return Condition(
        type=kind,
        status=status,
        reason=reason,
        message=message,
        last_transition_time=since,
        observed_generation=generation,
    )


def _complete(role: RoleStatus) -> bool:
    return role.ready_groups == role.groups == role.updated_groups and role.recovering_groups == 0


@dataclass(frozen=True)
class Recovery:
    count: int = 0
    last_seconds: float | None = None


def cluster_status(
    *,
    generation: int,
    revision: str,
    prefill: RoleStatus,
    decode: RoleStatus,
    recovery: Recovery,
    previous: Iterable[Condition],
    now: str,
) -> PDClusterStatus:
    """Ready: at least one ready prefill and decode group (the cluster serves). Progressing: groups are being
    created, scaled or rolled. Degraded: some group lost a member and is being recreated."""
    previous = tuple(previous)
    serving = prefill.ready_groups > 0 and decode.ready_groups > 0
    complete = _complete(prefill) and _complete(decode)
    recovering = prefill.recovering_groups + decode.recovering_groups
    counts = f"prefill {prefill.ready_groups}/{prefill.groups}, decode {decode.ready_groups}/{decode.groups} ready"
    conditions = [
        condition("Ready", serving, "Serving" if serving else "NoReadyPair", counts, generation, previous, now),
        condition(
            "Progressing",
            not complete,
            "Reconciling" if not complete else "Complete",
            f"{prefill.updated_groups + decode.updated_groups} groups up to date; {counts}",
            generation,
            previous,
            now,
        ),
        condition(
            "Degraded",
            recovering > 0,
            "GroupsRecovering" if recovering else "AllMembersAlive",
            f"{recovering} groups being recreated after a member died",
            generation,
            previous,
            now,
        ),
    ]
    if complete and serving:
        phase = Phase.READY
    elif recovering:
        phase = Phase.DEGRADED
    elif prefill.ready_groups == decode.ready_groups == 0 and prefill.updated_groups == decode.updated_groups == 0:
        phase = Phase.PENDING
    else:
        phase = Phase.PROGRESSING
    return PDClusterStatus(
        observed_generation=generation,
        phase=phase,
        revision=revision,
        conditions=conditions,
        prefill=prefill,
        decode=decode,
        recoveries=recovery.count,
        last_recovery_seconds=recovery.last_seconds,
    )
