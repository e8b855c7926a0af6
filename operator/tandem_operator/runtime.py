"""One PDCluster at run time: the event-driven fence path and a debounced reconcile loop.

``on_pod_event`` runs in the pod-event handler and fences at once (one etcd delete, then the Mooncake cleanup),
before anything slower. Every event also *kicks* the cluster's reconcile task, which coalesces bursts of kicks
into one pass: list the cluster's pods and Services, decide per role (``status`` -> ``recovery.apply_fences`` ->
``planner.plan``), act (Service epoch bump, pod deletes, server-side applies), bring the registry to the
desired entries (``registration``) and write status. A periodic resync catches anything a lost watch missed.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import time
from collections.abc import Callable, Collection, Mapping
from dataclasses import dataclass
from datetime import UTC, datetime
from typing import Any

from tandem.registry import Endpoint, IntegrityReport, Role
from tandem_operator.api.common import API_VERSION
from tandem_operator.api.pdcluster import PDClusterSpec
from tandem_operator.desired.naming import ClusterRef, group_name, mooncake_cluster_id
from tandem_operator.fencing import (
    Fence,
    FenceReason,
    GroupKey,
    Pod,
    fence_decision,
    pod_facts,
    stale_mooncake_keys,
)
from tandem_operator.integrity import integrity_decision, integrity_recreations
from tandem_operator.integrity_watch import IntegrityWatcher
from tandem_operator.k8s.events import EventType, Reason, Regarding, event_manifest
from tandem_operator.k8s.kube import Kube
from tandem_operator.metrics import FENCE_SECONDS, FENCES
from tandem_operator.recovery import FenceRecord, fence_annotation
from tandem_operator.registrar import Registrar

log = logging.getLogger("tandem.operator")


@dataclass(frozen=True)
class RuntimeOptions:
    instance: str  # reportingInstance of Events (the operator pod's name)
    resync_seconds: float = 30.0
    debounce_seconds: float = 0.05


@dataclass
class FenceTiming:
    """Measured for each fence (logged, and read by the live tests and the benchmark)."""

    group: GroupKey
    reason: str
    fenced_s: float  # event received -> endpoint key deleted
    cleaned_s: float  # event received -> stale Mooncake keys deleted
    stale_keys: int
    at: float  # monotonic


class ClusterRuntime:
    def __init__(
        self,
        ref: ClusterRef,
        spec: PDClusterSpec,
        kube: Kube,
        registrar: Registrar,
        options: RuntimeOptions,
        lost_nodes: Callable[[], Collection[str]],
    ) -> None:
        self.ref, self.spec, self.kube, self.registrar, self.options = ref, spec, kube, registrar, options
        self.lost_nodes = lost_nodes
        self.generation = 0
        self.conditions: list[Any] = []
        self.pods: dict[str, Pod] = {}
        self.registered: dict[GroupKey, Endpoint] = {}
        self.adopted: dict[GroupKey, Endpoint] = {}  # found in etcd at start (a previous operator's entries)
        self.fenced: dict[GroupKey, FenceRecord] = {}
        self.retiring: set[GroupKey] = set()
        self.recoveries = 0
        self.last_recovery_s: float | None = None
        self.fence_timings: list[FenceTiming] = []
        self.recovery_timings: list[tuple[GroupKey, float]] = []
        self.registry_lock = asyncio.Lock()  # orders registry puts against fences (see reconcile)
        self._kick = asyncio.Event()
        self._task: asyncio.Task[None] | None = None
        self._background: set[asyncio.Task[Any]] = set()
        self.reconciled = asyncio.Event()  # set after each successful pass (tests wait on it)
        # The routers' integrity reports (etcd key -> report); None until the watch has listed them once.
        self.integrity_reports: dict[str, IntegrityReport] | None = None
        self._integrity = IntegrityWatcher(registrar.endpoints, ref.namespace, ref.name, self._on_integrity)

    # -- lifecycle -------------------------------------------------------------------------------------------
    def update(self, spec: PDClusterSpec, generation: int, status: Mapping[str, Any]) -> None:
        self.spec, self.generation = spec, generation
        if not self.conditions and status:
            from tandem_operator.api.pdcluster import PDClusterStatus

            with contextlib.suppress(Exception):
                previous = PDClusterStatus.model_validate(status)
                self.conditions = list(previous.conditions)
                self.recoveries = max(self.recoveries, previous.recoveries)
                self.last_recovery_s = self.last_recovery_s or previous.last_recovery_seconds
        self.kick()

    async def start(self) -> None:
        self.adopted = await self.registrar.list_endpoints(self.ref.namespace, self.ref.name)
        self.registrar.on_lease_lost(self._reregister)
        self._task = asyncio.create_task(self._loop(), name=f"reconcile-{self.ref.namespace}/{self.ref.name}")
        self._integrity.start()
        self.kick()

    async def stop(self, *, unregister: bool) -> None:
        await self._integrity.stop()
        if self._task is not None:
            self._task.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await self._task
        for task in list(self._background):
            task.cancel()
        if unregister:
            await self.registrar.remove_cluster(self.ref.namespace, self.ref.name)

    def kick(self) -> None:
        self._kick.set()

    # -- the fast path ---------------------------------------------------------------------------------------
    async def on_pod_event(self, event_type: str, pod: Pod) -> Fence | None:
        received = time.monotonic()
        name = (pod.get("metadata") or {}).get("name", "")
        if event_type == "DELETED":
            self.pods.pop(name, None)
        else:
            self.pods[name] = pod
        decision = fence_decision(
            event_type,
            pod,
            lost_nodes=self.lost_nodes(),
            registered={k: e.epoch for k, e in self.registered.items()},
            fenced={k: r.epoch for k, r in self.fenced.items()},
            retiring=self.retiring,
        )
        if decision is not None:
            await self.fence(decision, received, extra=[pod])
        elif event_type == "DELETED":
            await self._clean([pod])  # a gone pod's Mooncake entries are stale whatever the reason
        self.kick()
        return decision

    async def fence(self, decision: Fence, received: float, extra: Collection[Pod] = ()) -> None:
        self.fenced[decision.group] = FenceRecord(decision.epoch, decision.reason.value, received)
        async with self.registry_lock:
            self.registered.pop(decision.group, None)
            self.adopted.pop(decision.group, None)
            await self.registrar.fence(self.ref.namespace, self.ref.name, decision.group)
        fenced_s = time.monotonic() - received
        self._background_task(self._record_fence(decision))
        members = [p for p in self.pods.values() if _group_of(p) == decision.group] + list(extra)
        stale = await self._clean(members)
        timing = FenceTiming(
            decision.group, decision.reason.value, fenced_s, time.monotonic() - received, stale, received
        )
        self.fence_timings.append(timing)
        FENCES.labels(decision.reason.value).inc()
        FENCE_SECONDS.observe(fenced_s)
        log.warning(
            "group fenced",
            extra={
                "cluster": f"{self.ref.namespace}/{self.ref.name}",
                "group": decision.group.name,
                "epoch": decision.epoch,
                "reason": decision.reason.value,
                "pod": decision.pod,
                "fenced_ms": round(fenced_s * 1000, 1),
                "cleaned_ms": round(timing.cleaned_s * 1000, 1),
                "stale_keys": stale,
            },
        )
        note = f"group {decision.group.name} epoch {decision.epoch}: {decision.reason.value} ({decision.pod})"
        self.emit(Reason.FENCED, f"endpoint removed from the registry: {note}", "Fence", EventType.WARNING)
        self.emit(Reason.STALE_METADATA_REMOVED, f"{stale} stale Mooncake metadata keys removed: {note}", "Clean")

    async def _record_fence(self, decision: Fence) -> None:
        """Persist the fence on the group's Service, so a restarted operator still recreates the group."""
        name = group_name(self.ref.name, decision.group.role, decision.group.index)
        try:
            await self.kube.merge_patch(
                f"/api/v1/namespaces/{self.ref.namespace}/services/{name}",
                fence_annotation(decision.epoch, decision.reason.value),
            )
        except Exception as err:
            log.warning("fence not recorded on the Service", extra={"service": name, "error": repr(err)})

    def _background_task(self, coro: Any) -> None:
        task = asyncio.create_task(coro)
        self._background.add(task)
        task.add_done_callback(self._background.discard)

    async def _clean(self, members: Collection[Pod]) -> int:
        facts = [f for f in (pod_facts(p) for p in members) if f is not None]
        if not facts:
            return 0
        return await self.registrar.delete_stale(stale_mooncake_keys(facts, mooncake_cluster_id(self.ref)))

    async def on_nodes_lost(self, nodes: Collection[str]) -> None:
        for pod in [p for p in self.pods.values() if (p.get("spec") or {}).get("nodeName") in nodes]:
            await self.on_pod_event("MODIFIED", pod)

    # -- integrity -------------------------------------------------------------------------------------------
    async def _on_integrity(self, reports: dict[str, IntegrityReport]) -> None:
        """A router's report changed: one Event per pair entering or leaving quarantine; the reconcile pass
        writes the ``IntegrityDegraded`` condition. A restarted operator announces the pairs it finds again.
        Groups reported as repeat offenders are fenced, so the reconcile pass recreates them (an
        ``IntegrityRecreate`` Event, and ``tandem_operator_fences_total{reason="IntegrityRepeatOffender"}``)."""
        decision = integrity_decision(
            self.integrity_reports or {},
            reports,
            self.conditions,
            self.generation,
            datetime.now(UTC).strftime("%Y-%m-%dT%H:%M:%SZ"),
        )
        self.integrity_reports = reports
        for event in decision.events:
            type_ = EventType.WARNING if event.warning else EventType.NORMAL
            self.emit(Reason(event.transition.value), event.note, event.transition.value.removeprefix("Pair"), type_)
            log.warning(
                "integrity quarantine changed",
                extra={
                    "cluster": f"{self.ref.namespace}/{self.ref.name}",
                    "transition": event.transition.value,
                    "prefill": event.pair.prefill,
                    "decode": event.pair.decode,
                },
            )
        fenced = {k: r.epoch for k, r in self.fenced.items()}
        for group, epoch, note in integrity_recreations(reports.values(), self.registered, fenced):
            self.emit(
                Reason.INTEGRITY_RECREATE, f"recreating group {group.name}: {note}", "Recreate", EventType.WARNING
            )
            await self.fence(Fence(group, epoch, FenceReason.INTEGRITY_REPEAT_OFFENDER, "integrity"), time.monotonic())
        self.kick()

    # -- events ----------------------------------------------------------------------------------------------
    def emit(self, reason: Reason, note: str, action: str, type_: EventType = EventType.NORMAL) -> None:
        """Post a Kubernetes Event about the PDCluster in the background (never delays fencing)."""
        regarding = Regarding(API_VERSION, "PDCluster", self.ref.name, self.ref.namespace, self.ref.uid)
        body = event_manifest(
            regarding,
            reason=reason,
            note=note,
            action=action,
            now=datetime.now(UTC),
            instance=self.options.instance,
            type_=type_,
        )
        self._background_task(self._post_event(body))

    async def _post_event(self, body: dict[str, Any]) -> None:
        try:
            await self.kube.post(f"/apis/events.k8s.io/v1/namespaces/{self.ref.namespace}/events", body)
        except Exception as err:
            log.warning("event not posted", extra={"reason": body.get("reason"), "error": repr(err)})

    # -- the reconcile loop ----------------------------------------------------------------------------------
    async def _loop(self) -> None:
        from tandem_operator.reconcile import reconcile_once

        while True:
            with contextlib.suppress(TimeoutError):
                await asyncio.wait_for(self._kick.wait(), self.options.resync_seconds)
            await asyncio.sleep(self.options.debounce_seconds)  # coalesce a burst of events into one pass
            self._kick.clear()
            try:
                await reconcile_once(self)
                self.reconciled.set()
            except asyncio.CancelledError:
                raise
            except Exception:
                log.exception("reconcile failed; retrying", extra={"cluster": f"{self.ref.namespace}/{self.ref.name}"})
                await asyncio.sleep(1.0)
                self.kick()

    async def _reregister(self) -> None:
        for endpoint in list(self.registered.values()):
            await self.registrar.put(self.ref.namespace, self.ref.name, endpoint)

    def role_pods(self, role: Role) -> list[Pod]:
        return [p for p in self.pods.values() if (g := _group_of(p)) is not None and g.role is role]


def _group_of(pod: Pod) -> GroupKey | None:
    facts = pod_facts(pod)
    return None if facts is None else facts.group
