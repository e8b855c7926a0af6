"""Carries out what the deciders chose, against Kubernetes and etcd: fences, planner steps, registry sync, Events.

It makes no decision of its own (``fencing`` says which group to fence, ``planner.steps`` what to delete and
create with which epoch and Event, ``registration`` which entries to put), so it is tested with a fake ``Kube``.

Order matters under concurrent pod events: a group is fenced (registry key deleted) before its pods are deleted;
registry puts re-check the fence under ``registry_lock``, so a pass that observed a group Ready just before it
died cannot advertise it again after the fast path fenced it.
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import Collection
from datetime import UTC, datetime
from typing import Any

from tandem.registry import Endpoint
from tandem_operator.act.k8s.apply import object_path
from tandem_operator.act.k8s.events import Regarding, event_manifest
from tandem_operator.act.k8s.kube import Kube
from tandem_operator.act.metrics import FENCE_SECONDS, FENCES, RECOVERY_SECONDS
from tandem_operator.act.registrar import Registrar
from tandem_operator.act.worker_metrics import WorkerMetrics
from tandem_operator.api.common import API_VERSION
from tandem_operator.decide.drain import DrainVerdict, drain_verdict
from tandem_operator.decide.fencing import Fence, stale_mooncake_keys
from tandem_operator.decide.observe import GroupKey, Pod, pod_facts
from tandem_operator.decide.planner import CreatePods, DeletePods, Drain
from tandem_operator.decide.reasons import EventType, Reason
from tandem_operator.decide.recovery import FenceRecord, fence_annotation, recovered
from tandem_operator.decide.registration import registry_changes
from tandem_operator.decide.state import ClusterState, FenceTiming
from tandem_operator.desired.naming import group_name, mooncake_cluster_id
from tandem_operator.desired.seeding import died_loading_from_peer

log = logging.getLogger("tandem.operator")
PARALLEL_WRITES = 16


async def bounded(jobs: list[Any], limit: int = PARALLEL_WRITES) -> None:
    gate = asyncio.Semaphore(limit)

    async def run(job: Any) -> None:
        async with gate:
            await job

    await asyncio.gather(*(run(j) for j in jobs))


class Executor:
    def __init__(self, state: ClusterState, kube: Kube, registrar: Registrar, instance: str) -> None:
        self.state, self.kube, self.registrar, self.instance = state, kube, registrar, instance
        self.registry_lock = asyncio.Lock()
        self.worker_metrics = WorkerMetrics()
        self._background: set[asyncio.Task[Any]] = set()

    @property
    def _ns(self) -> str:
        return self.state.ref.namespace

    # -- fencing -----------------------------------------------------------------------------------------------
    async def fence(self, decision: Fence, received: float, extra: Collection[Pod] = ()) -> None:
        """Delete the group's registry key first, then record the fence (and whether it died loading its weights from
        a peer) and remove stale Mooncake metadata."""
        state = self.state
        was_registered = decision.group in state.registered
        state.fenced_group(decision.group, FenceRecord(decision.epoch, decision.reason.value, received))
        await self.unregister(decision.group)
        fenced_s, fenced_at = time.monotonic() - received, time.time()
        peer_failed = died_loading_from_peer([*state.members(decision.group), *extra], was_registered)
        if peer_failed:
            state.died_loading_from_peer(decision.group, decision.epoch)
        self._background_task(self._record_fence(decision, peer_failed))
        stale = await self.clean([*state.members(decision.group), *extra])
        timing = FenceTiming(
            decision.group, decision.reason.value, fenced_s, time.monotonic() - received, stale, received
        )
        state.fence_timed(timing)
        FENCES.labels(decision.reason.value).inc()
        FENCE_SECONDS.observe(fenced_s)
        log.warning(
            "group fenced",
            extra={
                "cluster": f"{self._ns}/{state.ref.name}",
                "group": decision.group.name,
                "epoch": decision.epoch,
                "reason": decision.reason.value,
                "pod": decision.pod,
                "fenced_ms": round(fenced_s * 1000, 1),
                "fenced_at": round(fenced_at, 4),  # wall clock: the benchmark times pod delete -> key deleted
                "cleaned_ms": round(timing.cleaned_s * 1000, 1),
                "stale_keys": stale,
            },
        )
        note = f"group {decision.group.name} epoch {decision.epoch}: {decision.reason.value} ({decision.pod})"
        self.emit(Reason.FENCED, f"endpoint removed from the registry: {note}", "Fence", EventType.WARNING)
        self.emit(Reason.STALE_METADATA_REMOVED, f"{stale} stale Mooncake metadata keys removed: {note}", "Clean")

    async def unroute(self, group: GroupKey, pod: str, why: str | None = None) -> None:
        """A member of a registered group, or its node, turned NotReady: out of rotation only (same pods, same
        epoch). ``why``: the Event's reason, when not the pod's own readiness."""
        epoch = self.state.registered[group].epoch if group in self.state.registered else None
        await self.unregister(group)
        log.warning(
            "group unrouted",
            extra={"cluster": f"{self._ns}/{self.state.ref.name}", "group": group.name, "pod": pod, "why": why},
        )
        why = why or f"{pod} is NotReady; out of rotation until Ready (not recreated)"
        note = f"group {group.name} epoch {epoch}: {why}"
        self.emit(Reason.UNROUTED, note, "Unroute", EventType.WARNING)

    async def unregister(self, group: GroupKey) -> None:
        async with self.registry_lock:
            self.state.unregistered(group)
            await self.registrar.fence(self._ns, self.state.ref.name, group)

    async def _record_fence(self, decision: Fence, peer_load_failed: bool = False) -> None:
        """Persist the fence on the group's Service, so a restarted operator still recreates the group (from the
        node's copy after a failed peer load)."""
        name = group_name(self.state.ref.name, decision.group.role, decision.group.index)
        try:
            await self.kube.merge_patch(
                f"/api/v1/namespaces/{self._ns}/services/{name}",
                fence_annotation(decision.epoch, decision.reason.value, peer_load_failed),
            )
        except Exception as err:
            log.warning("fence not recorded on the Service", extra={"service": name, "error": repr(err)})

    async def clean(self, members: Collection[Pod]) -> int:
        facts = [f for f in (pod_facts(p) for p in members) if f is not None]
        if not facts:
            return 0
        return await self.registrar.delete_stale(stale_mooncake_keys(facts, mooncake_cluster_id(self.state.ref)))

    # -- planner steps -----------------------------------------------------------------------------------------
    async def delete(self, step: DeletePods) -> bool:
        """Carry out a delete step; False while its group is still draining (pods kept, call again later)."""
        if step.unregister:
            self.state.retired(step.group)
            await self.unregister(step.group)
        if step.drain is not None and not await self._drained(step.group, step.drain):
            return False
        self.state.drain_ended(step.group)
        if step.delete_service:
            self.state.going_away(step.group)
            await self.kube.delete(object_path(step.service))
            await bounded([self.kube.delete(object_path(extra)) for extra in step.extras])
        elif step.stamp_service:
            await self.kube.apply(step.service)
        await bounded(
            [self.kube.delete(f"/api/v1/namespaces/{self._ns}/pods/{n}", step.grace_seconds) for n in step.pods]
        )
        if step.pods:
            self.emit(
                step.event, f"group {step.group.name}: deleting {len(step.pods)} pods ({step.reason.value})", "Delete"
            )
        return True

    async def _drained(self, group: GroupKey, drain: Drain) -> bool:
        now = time.monotonic()
        if group not in self.state.draining:
            self.state.drain_started(group, now)
            self.emit(Reason.DRAINING, f"group {group.name}: unregistered; waiting for in-flight work to end", "Drain")
        elapsed = now - self.state.draining[group]
        count = await self.worker_metrics.in_flight(drain.metrics_url)
        verdict = drain_verdict(elapsed, count, drain.timeout_s)
        if verdict is DrainVerdict.TIMED_OUT:
            note = f"group {group.name}: {count} requests or transfers still in flight after {elapsed:.0f}s; deleting"
            self.emit(Reason.DRAIN_TIMED_OUT, note, "Drain", EventType.WARNING)
        elif verdict is DrainVerdict.DRAINED:
            log.info("group drained", extra={"group": group.name, "seconds": round(elapsed, 2)})
        return verdict is not DrainVerdict.WAIT

    async def create(self, step: CreatePods) -> None:
        service, *others = step.manifests
        await self.kube.apply(service)
        await bounded([self.kube.apply(manifest) for manifest in others])
        if step.event is not None:
            pods = sum(m["kind"] == "Pod" for m in others)
            self.emit(step.event, f"group {step.group.name} epoch {step.epoch}: creating {pods} pods", "Create")

    # -- the registry ------------------------------------------------------------------------------------------
    async def sync_registry(self, desired: dict[GroupKey, Endpoint]) -> None:
        """Put new or changed entries (under the operator's lease), then remove the rest (a group retired for its
        replacement goes after the replacement is in), and close finished recoveries."""
        state = self.state
        changes = registry_changes(desired, state.registered)
        stale_adopted = [k for k in state.adopted if k not in desired]
        put: list[str] = []
        for key, endpoint in changes.put.items():
            async with self.registry_lock:
                record = state.fenced.get(key)
                if record is not None and record.epoch >= endpoint.epoch:
                    continue  # fenced while this pass ran
                await self.registrar.put(self._ns, state.ref.name, endpoint)
                state.registered_endpoint(key, endpoint)
            put.append(f"group {key.name} epoch {endpoint.epoch} at {endpoint.url}")
        for key in [*changes.remove, *stale_adopted]:
            await self.unregister(key)
        state.adoption_over()
        if put:  # one Event per pass: a ramp registers hundreds of groups in a few passes
            note = put[0] if len(put) == 1 else f"{len(put)} groups registered: " + "; ".join(put)
            self.emit(Reason.REGISTERED, note, "Register")
        done = recovered(state.fenced, {k: e.epoch for k, e in state.registered.items()}, time.monotonic())
        for key, seconds in done.items():
            state.recovered_group(key, seconds)
            RECOVERY_SECONDS.observe(seconds)
            self.emit(Reason.GROUP_READY, f"group {key.name} recovered in {seconds:.2f}s (registered again)", "Recover")

    async def reregister(self) -> None:
        for endpoint in list(self.state.registered.values()):
            await self.registrar.put(self._ns, self.state.ref.name, endpoint)

    # -- Events ------------------------------------------------------------------------------------------------
    def emit(self, reason: Reason, note: str, action: str, type_: EventType = EventType.NORMAL) -> None:
        """Post a Kubernetes Event about the PDCluster in the background (never delays fencing)."""
        ref = self.state.ref
        regarding = Regarding(API_VERSION, "PDCluster", ref.name, ref.namespace, ref.uid)
        body = event_manifest(
            regarding,
            reason=reason,
            note=note,
            action=action,
            now=datetime.now(UTC),
            instance=self.instance,
            type_=type_,
        )
        self._background_task(self._post_event(body))

    async def _post_event(self, body: dict[str, Any]) -> None:
        try:
            await self.kube.post(f"/apis/events.k8s.io/v1/namespaces/{self._ns}/events", body)
        except Exception as err:
            log.warning("event not posted", extra={"reason": body.get("reason"), "error": repr(err)})

    def _background_task(self, coro: Any) -> None:
        task = asyncio.create_task(coro)
        self._background.add(task)
        task.add_done_callback(self._background.discard)

    async def close(self) -> None:
        for task in list(self._background):
            task.cancel()
        await self.worker_metrics.close()
