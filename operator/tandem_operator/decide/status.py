"""Role, pool and cluster status with conditions, from the observed groups (``observe``). Pure: time passed in."""

from __future__ import annotations

from collections.abc import Iterable, Mapping
from dataclasses import dataclass

from tandem_operator.api.common import Condition, ConditionStatus
from tandem_operator.api.pdcluster import PDClusterStatus, Phase, RoleStatus
from tandem_operator.api.pdpool import PDPoolStatus
from tandem_operator.decide.observe import GroupState, GroupView


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
