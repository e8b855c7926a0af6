"""One reconcile pass of a PDCluster (driven by ``runtime``): observe, decide with the pure layers, act, report.

The ``Reconciler`` owns the cluster's ``ClusterState`` and its ``Executor``. A pass lists the cluster's pods and
Services, decides per role (``observe.group_views`` -> ``recovery.apply_fences`` -> ``planner.plan`` ->
``planner.steps``), lets the executor carry the steps out, brings the registry to the desired entries
(``registration``) and writes status.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable
from datetime import UTC, datetime
from typing import Any

from tandem.registry import Endpoint, Role
from tandem_operator.act.executor import Executor, bounded
from tandem_operator.act.k8s.apply import INITIAL_SIZE_MANAGER, object_path
from tandem_operator.act.k8s.kube import ConflictError, Kube, KubeError
from tandem_operator.act.k8s.nodes import NodeDomains, StagedNodes
from tandem_operator.act.outdated import OutdatedPods
from tandem_operator.act.registrar import Registrar
from tandem_operator.api.common import API_VERSION, Condition
from tandem_operator.api.recipe import WeightsStatus
from tandem_operator.api.upgrade import InvalidTriggerError, parse_trigger
from tandem_operator.decide.fencing import Fence, FenceReason, NodeVerdicts, death_reason, groups_on_nodes
from tandem_operator.decide.integrity import CONDITION_TYPE as INTEGRITY_CONDITION
from tandem_operator.decide.integrity import integrity_condition, suspect_workers
from tandem_operator.decide.observe import GroupKey, GroupState, GroupView, group_views, slim_pod
from tandem_operator.decide.planner import CreatePods, DeletePods, DeleteReason, Observed, plan, seed_pool, steps
from tandem_operator.decide.recovery import (
    FenceRecord,
    Stuck,
    apply_fences,
    group_epochs,
    resumed_fences,
    service_epochs,
    service_fences,
    service_peer_load_failures,
    stuck_groups,
)
from tandem_operator.decide.registration import desired_endpoints, leader_nodes
from tandem_operator.decide.retry import reconcile_condition
from tandem_operator.decide.staging import staging
from tandem_operator.decide.state import ClusterState
from tandem_operator.decide.status import Recovery, cluster_status, pool_status, role_status
from tandem_operator.decide.upgrade import RoleUpgrade, gate, hold, pods_outdated_condition, restamp, trigger_done
from tandem_operator.desired.naming import (
    LABEL_CLUSTER,
    LABEL_COMPONENT,
    STAGING_COMPONENT,
    OwnerRef,
    compat_revision,
    pool_name,
    role_labels,
    selector_string,
)
from tandem_operator.desired.pods import RoleContext
from tandem_operator.desired.pools import pool_manifest
from tandem_operator.desired.staging_jobs import staging_jobs

log = logging.getLogger("tandem.operator")

# Groups created concurrently in one pass (each applies its Service, then its pods PARALLEL_WRITES at a time):
# one group after the other took 70 s for 100 four-node groups on a loaded API server (tandem bench operator). At
# 8 the 250-group ramp was latency-bound (pods created 6 a second, the API server half idle): 32 took it from
# 134 s to 77 s (same machine, load average about 4).
PARALLEL_GROUPS = 32


def _now() -> str:
    return datetime.now(UTC).strftime("%Y-%m-%dT%H:%M:%SZ")


def _status_body(kind: str, name: str, namespace: str, status: dict[str, Any]) -> dict[str, Any]:
    return {
        "apiVersion": API_VERSION,
        "kind": kind,
        "metadata": {"name": name, "namespace": namespace},
        "status": status,
    }


class Reconciler:
    def __init__(
        self,
        state: ClusterState,
        kube: Kube,
        registrar: Registrar,
        instance: str,
        nodes: Callable[[], NodeVerdicts],
        staged: StagedNodes | None = None,
    ) -> None:
        self.state, self.kube, self.nodes = state, kube, nodes
        self.executor = Executor(state, kube, registrar, instance)
        self.node_domains = NodeDomains(kube)
        self.staged = staged if staged is not None else StagedNodes(kube)  # the operator's, fed by the node watch
        self.outdated = OutdatedPods(kube, state.ref)
        self._pool_conditions: dict[Role, list[Condition]] = {}
        self._applied_status: dict[tuple[str, str], tuple[str, dict[str, Any]]] = {}

    async def ensure_pools(self) -> dict[Role, dict[str, Any]]:
        """The role's PDPools, created (with the initial size) when missing."""
        pools: dict[Role, dict[str, Any]] = {}
        for role in Role:
            manifest = pool_manifest(self.state.ref, self.state.spec, role, create=True)
            found = await self.kube.get(object_path(manifest))
            if found is None:
                try:
                    found = await self.kube.create(manifest, field_manager=INITIAL_SIZE_MANAGER)
                except ConflictError:  # the PDCluster handler created it first
                    found = await self.kube.get(object_path(manifest))
            if found is None:
                raise RuntimeError(f"PDPool {manifest['metadata']['name']} vanished while being created")
            pools[role] = found
        return pools

    async def apply_pools(self) -> None:
        """Create missing pools; apply the others without ``spec.replicas`` (the replicas rule)."""
        ref, spec = self.state.ref, self.state.spec
        for role in Role:
            manifest = pool_manifest(ref, spec, role, create=True)
            if await self.kube.get(object_path(manifest)) is None:
                try:
                    await self.kube.create(manifest, field_manager=INITIAL_SIZE_MANAGER)
                    continue
                except ConflictError:  # the reconcile loop created it first; apply below
                    pass
            await self.kube.apply(pool_manifest(ref, spec, role, create=False))

    async def reconcile_once(self) -> bool:
        """One pass; True when some group is still draining (the caller looks again after ``drain.POLL_S``)."""
        state, executor = self.state, self.executor
        ref, spec = state.ref, state.spec
        pools = await self.ensure_pools()
        selector = selector_string({LABEL_CLUSTER: ref.name})
        pods = await self.kube.list("v1", "Pod", ref.namespace, selector, keep=slim_pod)
        services = await self.kube.list("v1", "Service", ref.namespace, selector)
        state.pods_listed(pods)
        svc_epochs, pod_epochs = service_epochs(services), group_epochs(pods)
        for key, (epoch, reason) in resumed_fences(service_fences(services), state.fenced, pod_epochs).items():
            state.fenced_group(key, FenceRecord(epoch, reason, time.monotonic()))  # before this operator started
        nodes = self.nodes()
        observed = {role: await self._observe(role, pod_epochs, nodes) for role in Role}
        desired: dict[GroupKey, Endpoint] = {}
        roles = {}
        draining = False
        retirements: list[DeletePods] = []
        trigger, trigger_error = self._roll_trigger()
        upgrades: dict[Role, RoleUpgrade] = {}
        changes: dict[Role, list[str]] = {}
        pairable = await self._pairable(observed)
        peer_failed = service_peer_load_failures(services)
        for key, epoch in state.peer_load_failed.items():  # recorded before its Service patch lands
            peer_failed[key] = max(epoch, peer_failed.get(key, epoch))
        fabric = spec.fabric
        domains = await self.node_domains.resolve(fabric.domain_label, leader_nodes(pods)) if fabric else {}
        for role in Role:
            pool, views = pools[role], observed[role]
            owner = OwnerRef(API_VERSION, "PDPool", pool["metadata"]["name"], pool["metadata"]["uid"])
            ctx = RoleContext.build(ref, spec, role, owner)
            replicas = int(pool["spec"].get("replicas", 0))
            retiring = frozenset(k.index for k in state.retiring if k.role is role)
            surge = spec.role(role).max_surge_groups
            moving = frozenset(k.index for k in groups_on_nodes(state.role_pods(role), nodes.cordoned))
            upgrade = upgrades[role] = gate(
                role, views, ctx.template_hash, state.generation, spec.upgrade_policy, trigger, datetime.now(UTC)
            )
            planned = hold(views, upgrade, ctx.template_hash)  # a held group reads as current
            actions = plan(replicas, planned, ctx.template_hash, surge, retiring, (ctx.revision, pairable), moving)
            seeds = seed_pool(ctx, views, state.pods, self._serving(role, moving))
            fenced_keys = frozenset(state.fenced)
            seen = Observed(state.pods, svc_epochs, pod_epochs, fenced_keys, state.generation, seeds, peer_failed)
            role_steps = steps(ctx, actions, planned, seen)
            self._resume_abandoned_drains(role, {s.group for s in role_steps if isinstance(s, DeletePods)})
            for step in role_steps:
                if isinstance(step, DeletePods) and step.reason is DeleteReason.ROLLOUT:
                    retirements.append(step)  # after the registry sync below
                elif isinstance(step, DeletePods) and not await executor.delete(step):
                    draining = True
            await bounded([executor.create(s) for s in role_steps if isinstance(s, CreatePods)], PARALLEL_GROUPS)
            deleting = {s.group.index for s in role_steps if isinstance(s, DeletePods)}
            live = {i: v for i, v in views.items() if i not in deleting}
            fenced = {k: r.epoch for k, r in state.fenced.items()}
            desired.update(desired_endpoints(spec, role, live, state.role_pods(role), fenced, domains))
            roles[role] = role_status(views, replicas, ctx.template_hash)
            stale = restamp(live, ctx.template_hash, state.generation)
            await self.outdated.stamp([n for i in stale for n in live[i].pods], state.generation, ctx.template_hash)
            if upgrade.outdated:
                changes[role] = await self.outdated.changes(ctx, views[upgrade.outdated[0]], state.pods)
            generation = int(pool["metadata"].get("generation", 0))
            labels = selector_string(role_labels(ref.name, role))
            previous = self._pool_conditions.get(role, [])
            status = pool_status(generation, roles[role], len(views), labels, previous, _now())
            self._pool_conditions[role] = list(status.conditions)
            body = _status_body("PDPool", pool_name(ref.name, role), ref.namespace, status.to_wire())
            await self._apply_status(body, pool["metadata"]["uid"])
        await executor.sync_registry(desired)
        # A rollout retires a group once its replacement is Ready: the replacement is registered (above) before the
        # retired group is unregistered, so routers never lack the role in between (one group per role: the pass).
        for step in retirements:
            if not await executor.delete(step):
                draining = True
        outdated = pods_outdated_condition(
            upgrades.values(),
            changes,
            spec.upgrade_policy,
            ref.name,
            trigger_error,
            state.generation,
            state.conditions,
            datetime.now(UTC),
        )
        await self._write_status(roles[Role.PREFILL], roles[Role.DECODE], outdated, await self._stage(pods))
        if trigger_done(trigger, upgrades.values()) and state.roll_trigger is not None:
            await self.outdated.clear_trigger(state.roll_trigger)
        return draining

    def _roll_trigger(self) -> tuple[frozenset[Role], str | None]:
        """The roles the ``tandem.dev/roll`` annotation asks to roll, or none and why it is refused."""
        try:
            return parse_trigger(self.state.roll_trigger), None
        except InvalidTriggerError as err:
            return frozenset(), str(err)

    async def _pairable(self, observed: dict[Role, dict[int, GroupView]]) -> frozenset[str]:
        """Revisions routers can pair now: a registered prefill and decode of it whose leaders answer /health.
        Asked only while a revision change rolls (some group's revision differs from the spec's)."""
        state, current = self.state, compat_revision(self.state.spec)
        if all(v.revision == current for views in observed.values() for v in views.values()):
            return frozenset({current})
        answering = {
            key: endpoint
            for key, endpoint in state.registered.items()
            if await self.executor.worker_metrics.healthy(endpoint.url)
        }
        by_role = {r: {e.revision for k, e in answering.items() if k.role is r} for r in Role}
        return frozenset(by_role[Role.PREFILL] & by_role[Role.DECODE])

    async def _observe(self, role: Role, pod_epochs: dict[GroupKey, int], nodes: NodeVerdicts) -> dict[int, GroupView]:
        """The role's groups, after fencing the dead and stuck ones (a fenced group reads BROKEN). A group with a
        member on a node NotReady within its grace reads STARTING: not registered, not recreated."""
        state, spec = self.state, self.state.spec
        views = group_views(state.role_pods(role), spec.role(role).nodes_per_group, nodes.lost, nodes.unreachable)
        lifecycle = spec.lifecycle
        deadlines = (lifecycle.start_deadline_seconds, lifecycle.weight_download_deadline_seconds)
        stuck = stuck_groups(role, views, state.pods, datetime.now(UTC), *deadlines)
        await self._fence(role, views, stuck, pod_epochs, nodes.lost)
        state.retired_gone(role, views.keys())
        return apply_fences(role, views, {k: r.epoch for k, r in state.fenced.items()}, pod_epochs)

    def _serving(self, role: Role, cordoned: frozenset[int]) -> frozenset[int]:
        """The role's groups that may seed another's weights: registered, and neither retiring (draining), fenced,
        on a cordoned node nor held in quarantine by a live router."""
        state = self.state
        suspect = suspect_workers(state.integrity_reports.values()) if state.integrity_reports else frozenset()
        out = {*state.retiring, *state.draining, *state.fenced}
        return frozenset(
            key.index
            for key, endpoint in state.registered.items()
            if key.role is role and key not in out and key.index not in cordoned and endpoint.url not in suspect
        )

    def _resume_abandoned_drains(self, role: Role, deleting: set[GroupKey]) -> None:
        """A group drained for a deletion the plan no longer wants (scaled back up) serves again: it is no longer
        retiring, so it is registered again (its pods were never touched)."""
        for key in [k for k in self.state.draining if k.role is role and k not in deleting]:
            self.state.drain_abandoned(key)

    async def _stage(self, pods: list[dict[str, Any]]) -> WeightsStatus | None:
        """Label the nodes a prefetch or a staging Job finished on, and create the staging Jobs
        ``weightCache.stageNodes`` asks for (``decide.staging``); the weights status after that. Staging never fails
        a pass: a refused write is logged and tried again on the next."""
        spec, staged = self.state.spec, self.staged
        jobs = await self._staging_jobs()
        keys = staged.keys if jobs is not None else None
        plan = staging(spec, pods, staged.labels, keys, jobs or ())
        if plan is None:
            return None
        created = []
        for job in staging_jobs(self.state.ref, spec, plan.create_jobs):
            try:
                created.append(await self.kube.apply(job))
            except KubeError as err:
                log.warning("cannot create a staging Job", extra={"job": job["metadata"]["name"], "error": str(err)})
        for node in sorted(plan.to_label):
            await staged.label(node, plan.label)
        if not (plan.to_label or created):
            return plan.status
        after = staging(spec, pods, staged.labels, keys, [*(jobs or ()), *created])
        return None if after is None else after.status

    async def _staging_jobs(self) -> list[dict[str, Any]] | None:
        """The cluster's staging Jobs with ``weightCache.stageNodes``, else (or when they cannot be listed) None."""
        ref, cache = self.state.ref, self.state.spec.model.weight_cache
        if cache is None or not cache.stage_nodes:
            return None
        selector = selector_string({LABEL_CLUSTER: ref.name, LABEL_COMPONENT: STAGING_COMPONENT})
        try:
            return await self.kube.list("batch/v1", "Job", ref.namespace, selector)
        except KubeError as err:
            log.warning("cannot list the staging Jobs", extra={"error": str(err)})
            return None

    async def _write_status(
        self, prefill: Any, decode: Any, outdated: Condition, weights: WeightsStatus | None
    ) -> None:
        state = self.state
        cluster = cluster_status(
            generation=state.generation,
            revision=compat_revision(state.spec),
            prefill=prefill,
            decode=decode,
            recovery=Recovery(state.recoveries, state.last_recovery_s),
            previous=state.conditions,
            now=_now(),
        )
        conditions = [*cluster.conditions, outdated]
        if state.integrity_reports is not None:
            conditions.append(integrity_condition(state.integrity_reports, state.conditions, state.generation, _now()))
        else:  # not listed yet: keep what the status says until the watch has synced
            conditions += [c for c in state.conditions if c.type == INTEGRITY_CONDITION]
        failed = reconcile_condition(state.reconcile_failure, state.conditions, state.generation, _now())
        conditions += [failed] if failed is not None else []
        cluster = cluster.model_copy(update={"conditions": conditions, "weights": weights})
        state.conditions_written(conditions)
        body = _status_body("PDCluster", state.ref.name, state.ref.namespace, cluster.to_wire())
        await self._apply_status(body, state.ref.uid)

    async def report_failure(self) -> None:
        """A failed pass: the ``ReconcileFailed`` condition merged into the PDCluster's status, the others kept as the
        last pass wrote them (a merge patch: the failed pass may not have got as far as its status)."""
        state = self.state
        failed = reconcile_condition(state.reconcile_failure, state.conditions, state.generation, _now())
        if failed is None:
            return
        conditions = [*(c for c in state.conditions if c.type != failed.type), failed]
        state.conditions_written(conditions)
        path = object_path(_status_body("PDCluster", state.ref.name, state.ref.namespace, {})) + "/status"
        await self.kube.merge_patch(path, {"status": {"conditions": [c.to_wire() for c in conditions]}})

    async def _apply_status(self, body: dict[str, Any], uid: str) -> None:
        """Apply a status unless it is the one last applied to that object (by uid): most passes of a ramp change
        nothing in a status, and each apply is an API write that every watcher of the object receives."""
        key = (body["kind"], body["metadata"]["name"])
        if self._applied_status.get(key) == (uid, body):
            return
        await self.kube.apply(body, subresource="status")
        self._applied_status[key] = (uid, body)

    async def _fence(
        self,
        role: Role,
        views: dict[int, GroupView],
        stuck: dict[GroupKey, Stuck],
        pod_epochs: dict[GroupKey, int],
        lost: frozenset[str],
    ) -> None:
        """Fence BROKEN groups the fast path did not see die (missed events, or an operator restart), and groups
        stuck Starting/Incomplete past the start deadline (then recreated like a broken one)."""
        state = self.state
        for index, view in views.items():
            key = GroupKey(role, index)
            epoch = pod_epochs.get(key, 0)
            record = state.fenced.get(key)
            if key in state.retiring or (record and record.epoch == epoch):
                continue
            if key in stuck:
                why = FenceReason.DOWNLOAD_DEADLINE if stuck[key].downloading else FenceReason.START_DEADLINE
                await self.executor.fence(Fence(key, epoch, why, stuck[key].pod), time.monotonic())
            elif view.state is GroupState.BROKEN:
                members = [state.pods[name] for name in view.pods if name in state.pods]
                reasons = [death_reason("MODIFIED", p, lost) for p in members]
                reason = next((r for r in reasons if r is not None), FenceReason.POD_DELETED)  # a rank is missing
                pod = view.pods[0] if view.pods else ""
                await self.executor.fence(Fence(key, epoch, reason, pod), time.monotonic())
