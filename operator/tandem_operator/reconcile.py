"""One reconcile pass of a PDCluster (see ``runtime``): observe, decide with the pure layers, act, report.

Order matters for correctness under concurrent pod events: a group is fenced (registry key deleted) before its
pods are deleted; its Service's epoch is bumped before its pods are deleted, so a restarted operator recreates it
with a higher epoch; registry puts re-check the fence under the runtime's lock, so a pass that observed a group
Ready just before it died cannot advertise it again after the fast path fenced it.
"""

from __future__ import annotations

import asyncio
import time
from datetime import UTC, datetime
from typing import TYPE_CHECKING, Any

from kubernetes_asyncio.client.exceptions import ApiException

from tandem.registry import Endpoint, Role
from tandem_operator.api.common import API_VERSION
from tandem_operator.desired.naming import (
    LABEL_CLUSTER,
    OwnerRef,
    compat_revision,
    pool_name,
    role_labels,
    selector_string,
)
from tandem_operator.desired.pods import RoleContext, group_pod, group_service
from tandem_operator.desired.pools import pool_manifest
from tandem_operator.fencing import Fence, FenceReason, GroupKey, death_reason, pod_facts
from tandem_operator.integrity import CONDITION_TYPE as INTEGRITY_CONDITION
from tandem_operator.integrity import integrity_condition
from tandem_operator.k8s.apply import INITIAL_SIZE_MANAGER, object_path
from tandem_operator.k8s.events import Reason
from tandem_operator.metrics import RECOVERY_SECONDS
from tandem_operator.planner import DeleteGroup, DeleteReason, plan
from tandem_operator.recovery import (
    FenceRecord,
    apply_fences,
    group_epochs,
    recovered,
    resumed_fences,
    service_epochs,
    service_fences,
    stamp_epoch,
)
from tandem_operator.registration import desired_endpoints, next_epoch, registry_changes
from tandem_operator.status import (
    GroupState,
    GroupView,
    Recovery,
    cluster_status,
    group_views,
    pool_status,
    role_status,
)

if TYPE_CHECKING:
    from tandem_operator.runtime import ClusterRuntime

PARALLEL_WRITES = 16
# Groups created concurrently in one pass (each applies its Service, then its pods PARALLEL_WRITES at a time):
# one group after the other took 70 s for 100 four-node groups on a loaded API server (tandem bench operator).
PARALLEL_GROUPS = 8


def _now() -> str:
    return datetime.now(UTC).strftime("%Y-%m-%dT%H:%M:%SZ")


async def ensure_pools(rt: ClusterRuntime) -> dict[Role, dict[str, Any]]:
    """The role's PDPools, created (with the initial size) when missing."""
    pools: dict[Role, dict[str, Any]] = {}
    for role in Role:
        manifest = pool_manifest(rt.ref, rt.spec, role, create=True)
        found = await rt.kube.get(object_path(manifest))
        if found is None:
            try:
                found = await rt.kube.create(manifest, field_manager=INITIAL_SIZE_MANAGER)
            except ApiException as err:
                if err.status != 409:  # 409: the PDCluster handler created it first
                    raise
                found = await rt.kube.get(object_path(manifest))
        if found is None:
            raise RuntimeError(f"PDPool {manifest['metadata']['name']} vanished while being created")
        pools[role] = found
    return pools


async def apply_pools(rt: ClusterRuntime) -> None:
    """Create missing pools; apply the others without ``spec.replicas`` (the replicas rule)."""
    for role in Role:
        manifest = pool_manifest(rt.ref, rt.spec, role, create=True)
        if await rt.kube.get(object_path(manifest)) is None:
            try:
                await rt.kube.create(manifest, field_manager=INITIAL_SIZE_MANAGER)
                continue
            except ApiException as err:
                if err.status != 409:  # 409: the reconcile loop created it first; apply below
                    raise
        await rt.kube.apply(pool_manifest(rt.ref, rt.spec, role, create=False))


async def _bounded(jobs: list[Any], limit: int = PARALLEL_WRITES) -> None:
    gate = asyncio.Semaphore(limit)

    async def run(job: Any) -> None:
        async with gate:
            await job

    await asyncio.gather(*(run(j) for j in jobs))


async def reconcile_once(rt: ClusterRuntime) -> None:
    ns, spec = rt.ref.namespace, rt.spec
    pools = await ensure_pools(rt)
    selector = selector_string({LABEL_CLUSTER: rt.ref.name})
    pods = await rt.kube.list("v1", "Pod", ns, selector)
    services = await rt.kube.list("v1", "Service", ns, selector)
    rt.pods = {p["metadata"]["name"]: p for p in pods}
    svc_epochs, pod_epochs = service_epochs(services), group_epochs(pods)
    for key, (epoch, reason) in resumed_fences(service_fences(services), rt.fenced, pod_epochs).items():
        rt.fenced[key] = FenceRecord(epoch, reason, time.monotonic())  # fenced before this operator started
    lost = frozenset(rt.lost_nodes())
    desired: dict[GroupKey, Endpoint] = {}
    roles = {}
    for role in Role:
        pool = pools[role]
        owner = OwnerRef(API_VERSION, "PDPool", pool["metadata"]["name"], pool["metadata"]["uid"])
        ctx = RoleContext.build(rt.ref, spec, role, owner)
        role_pods = rt.role_pods(role)
        views = group_views(role_pods, spec.role(role).nodes_per_group, lost)
        views = apply_fences(role, views, {k: r.epoch for k, r in rt.fenced.items()}, pod_epochs)
        await _fence_broken(rt, role, views, pod_epochs, lost)
        rt.retiring -= {k for k in rt.retiring if k.role is role and k.index not in views}
        replicas = int(pool["spec"].get("replicas", 0))
        actions = plan(replicas, views, ctx.template_hash, spec.role(role).max_surge_groups)
        deleting: set[int] = set()
        creating = []
        for action in actions:
            key = GroupKey(role, action.index)
            if isinstance(action, DeleteGroup):
                deleting.add(action.index)
                await _delete_group(rt, ctx, key, action.reason, views[action.index], svc_epochs, pod_epochs)
            else:
                creating.append(_create_group(rt, ctx, key, views.get(action.index), svc_epochs, pod_epochs))
        await _bounded(creating, PARALLEL_GROUPS)
        live = {i: v for i, v in views.items() if i not in deleting}
        fenced = {k: r.epoch for k, r in rt.fenced.items()}
        desired.update(desired_endpoints(spec, role, live, role_pods, fenced))
        roles[role] = role_status(views, replicas, ctx.template_hash)
        status = pool_status(
            int(pool["metadata"].get("generation", 0)),
            roles[role],
            len(views),
            selector_string(role_labels(rt.ref.name, role)),
            [],
            _now(),
        )
        await rt.kube.apply(
            _status_body("PDPool", pool_name(rt.ref.name, role), ns, status.to_wire()), subresource="status"
        )
    await sync_registry(rt, desired)
    cluster = cluster_status(
        generation=rt.generation,
        revision=compat_revision(spec),
        prefill=roles[Role.PREFILL],
        decode=roles[Role.DECODE],
        recovery=Recovery(rt.recoveries, rt.last_recovery_s),
        previous=rt.conditions,
        now=_now(),
    )
    now = _now()
    conditions = list(cluster.conditions)
    if rt.integrity_reports is not None:
        conditions.append(integrity_condition(rt.integrity_reports, rt.conditions, rt.generation, now))
    else:  # not listed yet: keep what the status says until the watch has synced
        conditions += [c for c in rt.conditions if c.type == INTEGRITY_CONDITION]
    cluster = cluster.model_copy(update={"conditions": conditions})
    rt.conditions = conditions
    await rt.kube.apply(_status_body("PDCluster", rt.ref.name, ns, cluster.to_wire()), subresource="status")


def _status_body(kind: str, name: str, namespace: str, status: dict[str, Any]) -> dict[str, Any]:
    return {
        "apiVersion": API_VERSION,
        "kind": kind,
        "metadata": {"name": name, "namespace": namespace},
        "status": status,
    }


async def _fence_broken(
    rt: ClusterRuntime, role: Role, views: dict[int, GroupView], pod_epochs: dict[GroupKey, int], lost: frozenset[str]
) -> None:
    """Fence BROKEN groups the fast path did not see die (missed events, or an operator restart)."""
    for index, view in views.items():
        key = GroupKey(role, index)
        epoch = pod_epochs.get(key, 0)
        record = rt.fenced.get(key)
        if view.state is not GroupState.BROKEN or key in rt.retiring or (record and record.epoch == epoch):
            continue
        members = [rt.pods[name] for name in view.pods if name in rt.pods]
        reasons = [death_reason("MODIFIED", p, lost, serving=False) for p in members]
        reason = next((r for r in reasons if r is not None), FenceReason.POD_DELETED)  # else: a rank is missing
        await rt.fence(Fence(key, epoch, reason, view.pods[0] if view.pods else ""), time.monotonic())


async def _delete_group(
    rt: ClusterRuntime,
    ctx: RoleContext,
    key: GroupKey,
    reason: DeleteReason,
    view: GroupView,
    svc_epochs: dict[GroupKey, int],
    pod_epochs: dict[GroupKey, int],
) -> None:
    ns = rt.ref.namespace
    if reason is not DeleteReason.BROKEN:
        rt.retiring.add(key)
        async with rt.registry_lock:
            rt.registered.pop(key, None)
            await rt.registrar.fence(ns, rt.ref.name, key)
    if reason is DeleteReason.SCALE_DOWN:
        rt.fenced.pop(key, None)  # a group that is going away will not recover
        await rt.kube.delete(f"/api/v1/namespaces/{ns}/services/{group_service(ctx, key.index)['metadata']['name']}")
    else:  # the replacement is a new incarnation: record its epoch before the pods go
        epoch = next_epoch(svc_epochs.get(key), pod_epochs.get(key))
        if svc_epochs.get(key) != epoch:
            await rt.kube.apply(stamp_epoch(group_service(ctx, key.index), epoch))
            svc_epochs[key] = epoch
    grace = 0 if reason is DeleteReason.BROKEN else None
    alive = [n for n in view.pods if not (rt.pods.get(n, {}).get("metadata") or {}).get("deletionTimestamp")]
    await _bounded([rt.kube.delete(f"/api/v1/namespaces/{ns}/pods/{name}", grace) for name in alive])
    if alive:
        event = (
            Reason.GROUP_RECREATING
            if reason is DeleteReason.BROKEN
            else (Reason.SCALED_DOWN if reason is DeleteReason.SCALE_DOWN else Reason.ROLLOUT_STEP)
        )
        rt.emit(event, f"group {key.name}: deleting {len(alive)} pods ({reason.value})", "Delete")


async def _create_group(
    rt: ClusterRuntime,
    ctx: RoleContext,
    key: GroupKey,
    view: GroupView | None,
    svc_epochs: dict[GroupKey, int],
    pod_epochs: dict[GroupKey, int],
) -> None:
    existing_ranks = set()
    for name in view.pods if view is not None else ():
        facts = pod_facts(rt.pods.get(name, {}))
        if facts is not None:
            existing_ranks.add(facts.rank)
    epoch = pod_epochs[key] if existing_ranks else svc_epochs.get(key, 0)
    await rt.kube.apply(stamp_epoch(group_service(ctx, key.index), epoch))
    nodes = rt.spec.role(key.role).nodes_per_group
    missing = [rank for rank in range(nodes) if rank not in existing_ranks]
    await _bounded([rt.kube.apply(stamp_epoch(group_pod(ctx, key.index, rank, epoch), epoch)) for rank in missing])
    if view is None:
        reason = Reason.GROUP_RECREATING if key in rt.fenced else Reason.SCALED_UP
        rt.emit(reason, f"group {key.name} epoch {epoch}: creating {len(missing)} pods", "Create")


async def sync_registry(rt: ClusterRuntime, desired: dict[GroupKey, Endpoint]) -> None:
    """Put new or changed entries (under the operator's lease), remove the rest, and close finished recoveries."""
    changes = registry_changes(desired, rt.registered)
    stale_adopted = [k for k in rt.adopted if k not in desired]
    ns, name = rt.ref.namespace, rt.ref.name
    for key in [*changes.remove, *stale_adopted]:
        async with rt.registry_lock:
            rt.registered.pop(key, None)
            await rt.registrar.fence(ns, name, key)
    rt.adopted.clear()
    for key, endpoint in changes.put.items():
        async with rt.registry_lock:
            record = rt.fenced.get(key)
            if record is not None and record.epoch >= endpoint.epoch:
                continue  # fenced while this pass ran
            await rt.registrar.put(ns, name, endpoint)
            rt.registered[key] = endpoint
        rt.emit(Reason.REGISTERED, f"group {key.name} epoch {endpoint.epoch} at {endpoint.url}", "Register")
    done = recovered(rt.fenced, {k: e.epoch for k, e in rt.registered.items()}, time.monotonic())
    for key, seconds in done.items():
        del rt.fenced[key]
        rt.recoveries += 1
        rt.last_recovery_s = round(seconds, 3)
        rt.recovery_timings.append((key, seconds))
        RECOVERY_SECONDS.observe(seconds)
        rt.emit(Reason.GROUP_READY, f"group {key.name} recovered in {seconds:.2f}s (registered again)", "Recover")
