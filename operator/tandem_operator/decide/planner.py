"""What to do with one role's groups: a pure decision from (desired size, observed groups, current template).

Rules, in order:

1. **Scale down** to ``desired`` (plus one surge group while a rollout is under way): victims are chosen broken
   first, then incomplete, starting, ready; outdated before current; highest index first.
2. **Gang recovery**: a BROKEN group is deleted whole. It keeps its index while its pods terminate and is then
   recreated under the same name (step 4), so the registry key and Services stay stable.
3. **Rollout**, one group at a time, keeping serving capacity: outdated groups that are not Ready are replaced at
   once (they serve nothing). A Ready outdated group is deleted only when the role still has ``desired`` Ready
   groups without it: with ``maxSurgeGroups: 1`` a new group is created first (step 4) and the old one goes
   when the new one is Ready; with ``0`` the old one goes only when every group is Ready, and its replacement
   is created under its index, with the next epoch, once its pods are gone (on the nodes they free). When the
   rollout changes the compatibility revision (model, image, transfer), the last Ready group of the old revision
   is kept until both roles have a *registered* group of the new one (routers pair equal revisions only, and see
   only registered groups), so routers always have a pair (in place: when the role has more than one group).
4. **Fill** up to ``desired`` (``desired + 1`` while surging, only when every current group is Ready, so one new
   group starts at a time) at the lowest free indices; INCOMPLETE current groups get their missing pods.

**Node maintenance**: a group with a pod on a cordoned node (``cordoned``: ``kubectl drain``, cluster-autoscaler,
a managed node upgrade) is retired at once, drained like a scale-down (unregister, in-flight work ends, delete
pods, Service and PodDisruptionBudget), and a replacement is created in the same pass at a free index (the scheduler
keeps it off cordoned nodes). Its pods go only through the operator's drain: the PodDisruptionBudget
(``maxUnavailable: 0``) refuses the eviction until then, and the eviction of a pod being deleted goes through. A
scale-down takes groups on cordoned nodes first.

**Peer loading** (``spec.peerLoading``): a group created whole pulls its weights from a seed ``steps`` picks
(``desired.seeding.choose_seed``) among ``seed_pool``, unless its previous incarnation died loading from a peer.

``plan`` says *what*; ``steps`` turns each action into everything the executor needs, so the executor makes no
choice of its own: the registry entry to drop first, the epoch stamped on the Service before the pods go (a
restarted operator then recreates with a higher one), the pods still alive to delete and their grace, the
manifests (Service + missing ranks, epoch stamped) to apply, and the Event to report.
"""

from __future__ import annotations

from collections import Counter
from collections.abc import Mapping
from dataclasses import dataclass, field
from enum import StrEnum
from typing import Any

from tandem_operator.decide.observe import GroupKey, GroupState, GroupView, Pod, pod_facts
from tandem_operator.decide.reasons import Reason
from tandem_operator.decide.recovery import stamp_epoch
from tandem_operator.decide.registration import next_epoch
from tandem_operator.decide.upgrade import stamp_generation
from tandem_operator.desired.naming import group_name
from tandem_operator.desired.pods import RoleContext, group_extras, group_pod, group_service
from tandem_operator.desired.seeding import Seed, can_seed, choose_seed, weight_source


class DeleteReason(StrEnum):
    BROKEN = "MemberDied"
    SCALE_DOWN = "ScaleDown"
    ROLLOUT = "Rollout"
    NODE_CORDONED = "NodeCordoned"  # a member's node is cordoned (drain, upgrade, autoscaler): move the group


@dataclass(frozen=True)
class CreateGroup:
    """Apply the group's Service and every pod (existing ones are unchanged by the apply)."""

    index: int


@dataclass(frozen=True)
class DeleteGroup:
    """Delete every pod of the group (and its Service on scale-down)."""

    index: int
    reason: DeleteReason


Action = CreateGroup | DeleteGroup

_STATE_ORDER = {GroupState.BROKEN: 0, GroupState.INCOMPLETE: 1, GroupState.STARTING: 2, GroupState.READY: 3}


def plan(
    desired: int,
    groups: Mapping[int, GroupView],
    template_hash: str,
    max_surge: int,
    retiring: frozenset[int] = frozenset(),
    revisions: tuple[str, frozenset[str]] | None = None,
    cordoned: frozenset[int] = frozenset(),
) -> list[Action]:
    """``retiring``: groups already unregistered for a deletion (draining); they stay the first victims, so a
    drain is never abandoned for another group. ``revisions``: the current compatibility revision and the
    revisions that have a registered group in *both* roles, i.e. that routers can pair (None: no revision rule).
    ``cordoned``: groups with a pod on a cordoned node (moved elsewhere, see the module's docstring)."""
    actions: list[Action] = []
    rolling = any(g.template_hash != template_hash for g in groups.values())
    budget = desired + (max_surge if rolling else 0)

    def victim_order(g: GroupView) -> tuple[bool, bool, int, bool, int]:
        current = g.template_hash == template_hash
        return (g.index not in retiring, g.index not in cordoned, _STATE_ORDER[g.state], current, -g.index)

    ordered = sorted(groups.values(), key=victim_order)
    surplus = ordered[: max(0, len(groups) - budget)]
    actions += [DeleteGroup(g.index, _removal(g.index, cordoned)) for g in surplus]
    remaining = {g.index: g for g in ordered[len(surplus) :]}

    actions += [
        DeleteGroup(i, DeleteReason.BROKEN) for i, g in sorted(remaining.items()) if g.state is GroupState.BROKEN
    ]
    moving = {i for i, g in remaining.items() if i in cordoned and g.state is not GroupState.BROKEN}
    actions += [DeleteGroup(i, DeleteReason.NODE_CORDONED) for i in sorted(moving)]
    staying = {i: g for i, g in remaining.items() if i not in moving}

    outdated = [g for g in staying.values() if g.template_hash != template_hash and g.state is not GroupState.BROKEN]
    replaced = [g for g in outdated if g.state is not GroupState.READY]
    ready = sum(g.state is GroupState.READY for g in staying.values())
    ready_outdated = sorted(
        (g for g in outdated if g.state is GroupState.READY), key=lambda g: (g.index not in retiring, -g.index)
    )
    # In place, a role of one group cannot keep its old revision serving: there is nothing to replace it with.
    if ready_outdated and revisions is not None and (max_surge > 0 or desired > 1):
        ready_outdated = [g for g in ready_outdated if _may_retire(g, ready_outdated, *revisions)]
    if ready_outdated:
        everything_ready = ready == len(remaining) == desired
        if ready - 1 >= desired or (max_surge == 0 and everything_ready):
            replaced.append(ready_outdated[0])
    actions += [DeleteGroup(g.index, DeleteReason.ROLLOUT) for g in sorted(replaced, key=lambda g: g.index)]

    current = [g for g in staying.values() if g.template_hash == template_hash and g.state is not GroupState.BROKEN]
    still_outdated = len(outdated) > len(replaced)
    target = desired
    if still_outdated and max_surge > 0 and all(g.state is GroupState.READY for g in current):
        target = desired + max_surge
    # In place, a replaced group is recreated under its own index once its pods are gone (as a broken one), with the
    # next epoch: its successor takes the nodes it frees, and on them its ports must differ (a decode still holding
    # a request for the old prefill would otherwise keep talking to the new one at the old bootstrap address).
    live = len(staying) - (len(replaced) if max_surge > 0 else 0)
    actions += [CreateGroup(i) for i, g in sorted(staying.items()) if g in current and g.state is GroupState.INCOMPLETE]
    free = (i for i in range(len(groups) + target + 1) if i not in groups)
    actions += [CreateGroup(next(free)) for _ in range(max(0, target - live))]
    return actions


def _removal(index: int, cordoned: frozenset[int]) -> DeleteReason:
    """Why a surplus group goes: its node's maintenance, or the scale-down itself."""
    return DeleteReason.NODE_CORDONED if index in cordoned else DeleteReason.SCALE_DOWN


def _may_retire(group: GroupView, ready_outdated: list[GroupView], current: str, pairable: frozenset[str]) -> bool:
    """Keep the last Ready group of an old revision until routers can pair the current one."""
    if group.revision == current or current in pairable:
        return True
    return sum(g.revision == group.revision for g in ready_outdated) > 1


@dataclass(frozen=True)
class Drain:
    """Wait for the serving group's in-flight work to reach 0 (read at ``metrics_url``) before its pods go."""

    metrics_url: str
    timeout_s: float


@dataclass(frozen=True)
class DeletePods:
    """Retire or recreate one group: unregister (a deliberate retirement), stamp the next epoch on the Service
    (recreate or rollout) or delete the Service (scale-down), then delete the pods still alive."""

    group: GroupKey
    reason: DeleteReason
    unregister: bool
    service: dict[str, Any]  # the group's Service, stamped with the next epoch unless it is deleted
    delete_service: bool  # with the group's other objects (``extras``)
    stamp_service: bool  # apply ``service`` (its epoch changed) before the pods go
    pods: tuple[str, ...]  # members not already terminating
    grace_seconds: int | None  # 0 for a broken group (NCCL cannot lose a rank); None: the pod's own
    event: Reason
    drain: Drain | None = None  # a serving group retired on purpose (scale-down, rollout)
    extras: tuple[dict[str, Any], ...] = ()  # PodDisruptionBudget, PodGroup: deleted with the Service


@dataclass(frozen=True)
class CreatePods:
    """Apply the group's Service, its other objects (PodDisruptionBudget, PodGroup) and its missing ranks; the
    Service and pods are stamped with ``epoch``."""

    group: GroupKey
    epoch: int
    manifests: tuple[dict[str, Any], ...]  # the Service first, then the group's other objects, then the pods
    event: Reason | None  # None when only missing ranks of an existing group are added


Step = DeletePods | CreatePods


@dataclass(frozen=True)
class SeedPool:
    """The role's groups a created group may load its weights from, and the loads in flight per seed."""

    candidates: tuple[Seed, ...]
    loading: Mapping[str, int]  # by ``Seed.ref``
    limit: int  # spec.peerLoading.maxLoadsPerSeed


def seed_pool(
    ctx: RoleContext, views: Mapping[int, GroupView], pods: Mapping[str, Pod], serving: frozenset[int]
) -> SeedPool | None:
    """None without ``spec.peerLoading``. Candidates: groups in ``serving`` (registered, and neither draining,
    retiring, fenced, quarantined nor on a cordoned node: the caller knows) that are Ready with the role's current
    template (the same revision, flags and layout, the seed flag included; a held outdated group is not one) and
    read their weights themselves, by index. Loads in flight: groups not Ready yet whose pods pull from a seed."""
    peer = ctx.spec.peer_loading
    if not peer.enabled:
        return None
    port = ctx.spec.role(ctx.role).ports.http
    candidates: list[Seed] = []
    loading: Counter[str] = Counter()
    for index, view in sorted(views.items()):
        members = [pods[n] for n in view.pods if n in pods]
        if view.state in (GroupState.STARTING, GroupState.INCOMPLETE):
            seeds = {s.seed for s in (weight_source(p) for p in members) if s is not None and s.peer}
            loading.update(seeds)
            continue
        if index not in serving or view.state is not GroupState.READY or view.template_hash != ctx.template_hash:
            continue
        leader = next((f for f in (pod_facts(p) for p in members) if f is not None and f.rank == 0), None)
        if leader is None or not leader.ip or not can_seed(members):
            continue
        name = group_name(ctx.cluster.name, ctx.role, index)
        candidates.append(Seed(index, name, leader.epoch, leader.ip, port))
    return SeedPool(tuple(candidates), dict(loading), peer.max_loads_per_seed)


@dataclass(frozen=True)
class Observed:
    """What ``steps`` reads besides the actions: pods by name, the epochs recorded on Services and pods, and the
    PDCluster's generation (stamped on new pods: ``upgrade.py``); with peer loading, the role's seeds and the epoch
    of each group's last incarnation that died loading from a peer."""

    pods: Mapping[str, Pod]
    service_epochs: Mapping[GroupKey, int]
    pod_epochs: Mapping[GroupKey, int]
    fenced: frozenset[GroupKey]
    generation: int = 0
    seeds: SeedPool | None = None
    peer_load_failed: Mapping[GroupKey, int] = field(default_factory=dict)


_DELETE_EVENTS = {
    DeleteReason.BROKEN: Reason.GROUP_RECREATING,
    DeleteReason.SCALE_DOWN: Reason.SCALED_DOWN,
    DeleteReason.ROLLOUT: Reason.ROLLOUT_STEP,
    DeleteReason.NODE_CORDONED: Reason.NODE_CORDONED,
}
_REMOVED = (DeleteReason.SCALE_DOWN, DeleteReason.NODE_CORDONED)  # the index goes with its Service (not recreated)


def steps(ctx: RoleContext, actions: list[Action], views: Mapping[int, GroupView], seen: Observed) -> list[Step]:
    """The executor's steps for ``plan``'s actions, in order."""
    svc_epochs = dict(seen.service_epochs)  # a delete's new epoch is what a later create in this pass uses
    loading = Counter(seen.seeds.loading if seen.seeds is not None else {})  # and a create's seed the next one's
    deleting = {a.index for a in actions if isinstance(a, DeleteGroup)}
    result: list[Step] = []
    for action in actions:
        key = GroupKey(ctx.role, action.index)
        view = views.get(action.index)
        if isinstance(action, DeleteGroup):
            result.append(_delete_step(ctx, key, action.reason, view, seen, svc_epochs))
        else:
            seed = None
            if view is None and seen.seeds is not None and not _failed_from_peer(key, seen, svc_epochs.get(key, 0)):
                candidates = [c for c in seen.seeds.candidates if c.index not in deleting]
                seed = choose_seed(candidates, loading, seen.seeds.limit)
            if seed is not None:
                loading[seed.ref] += 1
            result.append(_create_step(ctx, key, view, seen, svc_epochs, seed))
    return result


def _failed_from_peer(key: GroupKey, seen: Observed, epoch: int) -> bool:
    """The incarnation before ``epoch`` died loading from a peer: this one reads the node's copy."""
    failed = seen.peer_load_failed.get(key)
    return failed is not None and failed >= epoch - 1


def _delete_step(
    ctx: RoleContext,
    key: GroupKey,
    reason: DeleteReason,
    view: GroupView | None,
    seen: Observed,
    svc_epochs: dict[GroupKey, int],
) -> DeletePods:
    service = group_service(ctx, key.index)
    stamp = False
    if reason not in _REMOVED:  # the replacement is a new incarnation
        pod_epoch = seen.pod_epochs.get(key)
        epoch = next_epoch(svc_epochs.get(key), pod_epoch)
        if pod_epoch is not None and svc_epochs.get(key, -1) > pod_epoch:  # stamped by an earlier pass: keep it
            epoch = svc_epochs[key]
        stamp = svc_epochs.get(key) != epoch
        svc_epochs[key] = epoch
        service = stamp_epoch(service, epoch)
    names = view.pods if view is not None else ()
    alive = tuple(n for n in names if not ((seen.pods.get(n) or {}).get("metadata") or {}).get("deletionTimestamp"))
    drain = None
    if reason is not DeleteReason.BROKEN and view is not None and view.state is GroupState.READY:
        leader = next((f for f in (pod_facts(seen.pods.get(n) or {}) for n in names) if f and f.rank == 0), None)
        if leader is not None and leader.ip:
            url = f"http://{leader.ip}:{ctx.spec.role(ctx.role).ports.http}/metrics"
            drain = Drain(url, ctx.spec.lifecycle.drain_timeout_seconds)
    return DeletePods(
        group=key,
        reason=reason,
        unregister=reason is not DeleteReason.BROKEN,
        service=service,
        delete_service=reason in _REMOVED,
        stamp_service=stamp,
        pods=alive,
        grace_seconds=0 if reason is DeleteReason.BROKEN else None,
        event=_DELETE_EVENTS[reason],
        drain=drain,
        extras=tuple(group_extras(ctx, key.index)) if reason in _REMOVED else (),
    )


def _create_step(
    ctx: RoleContext,
    key: GroupKey,
    view: GroupView | None,
    seen: Observed,
    svc_epochs: Mapping[GroupKey, int],
    seed: Seed | None = None,
) -> CreatePods:
    existing = set()
    for name in view.pods if view is not None else ():
        facts = pod_facts(seen.pods.get(name) or {})
        if facts is not None:
            existing.add(facts.rank)
    epoch = seen.pod_epochs[key] if existing else svc_epochs.get(key, 0)
    nodes = ctx.spec.role(ctx.role).nodes_per_group
    pods = [
        stamp_generation(
            stamp_epoch(group_pod(ctx, key.index, rank, epoch, seed), epoch), seen.generation, ctx.template_hash
        )
        for rank in range(nodes)
        if rank not in existing
    ]
    event = None
    if view is None:
        event = Reason.GROUP_RECREATING if key in seen.fenced else Reason.SCALED_UP
    service = stamp_epoch(group_service(ctx, key.index), epoch)
    return CreatePods(key, epoch, (service, *group_extras(ctx, key.index), *pods), event)
