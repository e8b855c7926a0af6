"""One PDCluster at run time: the event-driven fence path and a debounced reconcile loop.

``on_pod_event`` runs in the pod-event handler and fences at once (one etcd delete, then the Mooncake cleanup),
before anything slower. Every event also *kicks* the cluster's reconcile task, which coalesces bursts of kicks
into one pass (``reconcile.Reconciler``). A periodic resync catches anything a lost watch missed.

Nodes: ``on_nodes_changed`` runs each of the node's pods through the same path (a NotReady node unroutes its
groups; a deleted one fences them), and a timer kicks a pass when the first NotReady node's grace
(``lifecycle.nodeLostGraceSeconds``) runs out, which fences its groups (``fencing.node_verdicts``). A cordoned node
(``cordoned_nodes``) kicks a pass, whose planner drains its groups and creates them elsewhere.
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

import pydantic

from tandem.integrity_watch import IntegrityWatcher
from tandem.registry import IntegrityReport
from tandem_operator.act.k8s.kube import Kube, PermanentError
from tandem_operator.act.k8s.nodes import StagedNodes
from tandem_operator.act.registrar import Registrar
from tandem_operator.api.pdcluster import PDClusterSpec, PDClusterStatus
from tandem_operator.autoscale.loop import Autoscaler
from tandem_operator.decide.drain import POLL_S as DRAIN_POLL_S
from tandem_operator.decide.fencing import (
    Fence,
    FenceReason,
    NodeOutage,
    NodeVerdicts,
    fence_decision,
    node_verdicts,
    pod_event,
    unroute_decision,
)
from tandem_operator.decide.integrity import integrity_decision, integrity_recreations
from tandem_operator.decide.observe import Pod, slim_pod
from tandem_operator.decide.reasons import EventType, Reason
from tandem_operator.decide.retry import ReconcileFailure, retry_delay
from tandem_operator.decide.state import ClusterState
from tandem_operator.desired.naming import ClusterRef
from tandem_operator.run.reconcile import Reconciler

log = logging.getLogger("tandem.operator")


@dataclass(frozen=True)
class RuntimeOptions:
    instance: str  # reportingInstance of Events (the operator pod's name)
    resync_seconds: float = 30.0
    debounce_seconds: float = 0.05


NODE_CHECK_SLACK_S = 0.1  # the grace timer fires this much after the grace, so the pass finds it run out


class ClusterRuntime:
    def __init__(
        self,
        ref: ClusterRef,
        spec: PDClusterSpec,
        kube: Kube,
        registrar: Registrar,
        options: RuntimeOptions,
        node_outages: Callable[[], Mapping[str, NodeOutage]],
        cordoned_nodes: Callable[[], Collection[str]] = frozenset,
        staged_nodes: StagedNodes | None = None,
    ) -> None:
        self.options, self.registrar, self.node_outages = options, registrar, node_outages
        self.cordoned_nodes = cordoned_nodes
        self.state = ClusterState(ref, spec)
        self.reconciler = Reconciler(self.state, kube, registrar, options.instance, self.node_verdicts, staged_nodes)
        self._node_check: asyncio.TimerHandle | None = None
        self.executor = self.reconciler.executor
        self._kick = asyncio.Event()
        self._task: asyncio.Task[None] | None = None
        self.autoscaler = Autoscaler(self.state, kube, self.executor.worker_metrics)
        self._autoscale_task: asyncio.Task[None] | None = None
        self.reconciled = asyncio.Event()  # set after each successful pass (tests wait on it)
        self._failures = 0  # failed passes in a row
        self._new_generation = asyncio.Event()  # the spec changed since the last pass began (ends a backoff)
        self._integrity = IntegrityWatcher(
            registrar.endpoints, ref.namespace, ref.name, self._on_integrity, tls=registrar.tls
        )

    @property
    def ref(self) -> ClusterRef:
        return self.state.ref

    # -- lifecycle -------------------------------------------------------------------------------------------
    def update(self, spec: PDClusterSpec, generation: int, status: Mapping[str, Any]) -> None:
        state = self.state
        if generation != state.generation:
            self._new_generation.set()
        state.spec_changed(spec, generation)
        if not state.conditions and status:
            with contextlib.suppress(pydantic.ValidationError):
                previous = PDClusterStatus.model_validate(status)
                state.status_restored(previous.conditions, previous.recoveries, previous.last_recovery_seconds)
        self.kick()

    def set_roll_trigger(self, value: str | None) -> None:
        """The PDCluster's ``tandem.dev/roll`` annotation (an annotation changes no generation: no update event)."""
        if value != self.state.roll_trigger:
            self.state.roll_trigger_seen(value)
            self.kick()

    async def start(self) -> None:
        self.state.adopt(await self.registrar.list_endpoints(self.ref.namespace, self.ref.name))
        self.registrar.on_lease_lost(self.executor.reregister)
        self._task = asyncio.create_task(self._loop(), name=f"reconcile-{self.ref.namespace}/{self.ref.name}")
        self._autoscale_task = asyncio.create_task(self.autoscaler.run(), name=f"autoscale-{self.ref.name}")
        self._integrity.start()
        self.kick()

    async def stop(self, *, unregister: bool) -> None:
        if self._node_check is not None:
            self._node_check.cancel()
        await self._integrity.stop()
        for task in (self._task, self._autoscale_task):
            if task is not None:
                task.cancel()
                with contextlib.suppress(asyncio.CancelledError):
                    await task
        await self.executor.close()
        if unregister:
            await self.registrar.remove_cluster(self.ref.namespace, self.ref.name)

    def kick(self) -> None:
        self._kick.set()

    # -- the fast path ---------------------------------------------------------------------------------------
    async def on_pod_event(self, event_type: str, pod: Pod) -> Fence | None:
        received = time.monotonic()
        state = self.state
        pod = slim_pod(pod)
        name = pod["metadata"].get("name", "")
        state.pod_seen(name, None if event_type == "DELETED" else pod)
        nodes = self.node_verdicts()
        fenced = {k: r.epoch for k, r in state.fenced.items()}
        event = pod_event(event_type, pod, nodes.lost)
        decision = fence_decision(event, fenced=fenced, retiring=state.retiring)
        registered = {k: e.epoch for k, e in state.registered.items()}
        unrouted = unroute_decision(event, registered=registered, unreachable_nodes=nodes.unreachable)
        if decision is not None:
            await self.executor.fence(decision, received, extra=[pod])
        elif unrouted is not None:
            node, why = (pod.get("spec") or {}).get("nodeName"), None
            if node in nodes.unreachable:
                grace = self.state.spec.lifecycle.node_lost_grace_seconds
                why = f"{name}'s node {node} is NotReady; out of rotation, recreated if NotReady for {grace} s"
            await self.executor.unroute(unrouted, str(name), why)
        elif event_type == "DELETED":
            await self.executor.clean([pod])  # a gone pod's Mooncake entries are stale whatever the reason
        self.kick()
        return decision

    def node_verdicts(self) -> NodeVerdicts:
        """The nodes' outages under this cluster's grace, now, and the cordoned nodes."""
        grace = self.state.spec.lifecycle.node_lost_grace_seconds
        return node_verdicts(self.node_outages(), grace, datetime.now(UTC), self.cordoned_nodes())

    async def on_nodes_changed(self, nodes: Collection[str]) -> None:
        """Nodes turned NotReady, Ready again or were deleted: their pods' groups are unrouted, fenced, or left to
        the reconcile pass to register again; the grace timer is set for the first NotReady node."""
        for pod in [p for p in self.state.pods.values() if (p.get("spec") or {}).get("nodeName") in nodes]:
            await self.on_pod_event("MODIFIED", pod)
        self._arm_node_check()
        self.kick()

    def _arm_node_check(self) -> None:
        """Kick a pass when the first unreachable node's grace runs out (it fences that node's groups)."""
        if self._node_check is not None:
            self._node_check.cancel()
            self._node_check = None
        delay = self.node_verdicts().next_check_s
        if delay is not None:
            self._node_check = asyncio.get_running_loop().call_later(delay + NODE_CHECK_SLACK_S, self.kick)

    # -- integrity -------------------------------------------------------------------------------------------
    async def _on_integrity(self, reports: dict[str, IntegrityReport]) -> None:
        """A router's report changed: one Event per pair entering or leaving quarantine; the reconcile pass
        writes the ``IntegrityDegraded`` condition. A restarted operator announces the pairs it finds again.
        Groups reported as repeat offenders are fenced, so the reconcile pass recreates them (an
        ``IntegrityRecreate`` Event, and ``tandem_operator_fences_total{reason="IntegrityRepeatOffender"}``)."""
        state = self.state
        decision = integrity_decision(
            state.integrity_reports or {},
            reports,
            state.conditions,
            state.generation,
            datetime.now(UTC).strftime("%Y-%m-%dT%H:%M:%SZ"),
        )
        state.integrity_listed(reports)
        for event in decision.events:
            type_ = EventType.WARNING if event.warning else EventType.NORMAL
            action = event.transition.value.removeprefix("Pair")
            self.executor.emit(Reason(event.transition.value), event.note, action, type_)
            log.warning(
                "integrity quarantine changed",
                extra={
                    "cluster": f"{self.ref.namespace}/{self.ref.name}",
                    "transition": event.transition.value,
                    "prefill": event.pair.prefill,
                    "decode": event.pair.decode,
                },
            )
        await self._recreate_repeat_offenders()
        self.kick()

    async def _recreate_repeat_offenders(self) -> None:
        """Fence every registered incarnation a live report names as a repeat offender. Level-triggered: run on
        each report change and after each reconcile pass, so a group that was not registered when the report came
        (registering in the same instant, or unrouted meanwhile) is recreated once it is. The snapshot is taken
        under the registry lock, so a put in flight is either complete in ``registered`` or not yet visible."""
        state = self.state
        async with self.executor.registry_lock:
            fenced = {k: r.epoch for k, r in state.fenced.items()}
            reports = (state.integrity_reports or {}).values()
            found = integrity_recreations(reports, dict(state.registered), fenced)
        for group, epoch, note in found:
            if (record := state.fenced.get(group)) is not None and record.epoch == epoch:
                continue  # fenced by the other caller while this one fenced an earlier group
            note = f"recreating group {group.name}: {note}"
            self.executor.emit(Reason.INTEGRITY_RECREATE, note, "Recreate", EventType.WARNING)
            fence = Fence(group, epoch, FenceReason.INTEGRITY_REPEAT_OFFENDER, "integrity")
            await self.executor.fence(fence, time.monotonic())

    # -- the reconcile loop ----------------------------------------------------------------------------------
    async def _loop(self) -> None:
        last_pass_s = 0.0
        while True:
            with contextlib.suppress(TimeoutError):
                await asyncio.wait_for(self._kick.wait(), self.options.resync_seconds)
            # Coalesce a burst of events into one pass, and leave the event loop (the fast path) and the API server
            # at least as long between passes as the last pass took: while a 1,000-pod fleet ramps up every pod
            # event kicks, and back-to-back passes each listed every pod.
            await asyncio.sleep(max(self.options.debounce_seconds, last_pass_s))
            self._kick.clear()
            self._new_generation.clear()
            began = time.monotonic()
            failure = self.state.pass_failed(None)  # this pass writes False
            try:
                if await self.reconciler.reconcile_once():  # groups still draining: look again soon
                    asyncio.get_running_loop().call_later(DRAIN_POLL_S, self.kick)
                await self._recreate_repeat_offenders()  # groups this pass registered
                self._arm_node_check()  # the grace may have changed with the spec, or a node's run out
                self.reconciled.set()
                last_pass_s = time.monotonic() - began
                self._failures = 0
            except asyncio.CancelledError:
                raise
            except Exception as err:
                await self._failed(err, failure)

    async def _failed(self, err: Exception, before: ReconcileFailure | None) -> None:
        """A failed pass: logged, on the PDCluster (condition; an Event per distinct error), retried after the
        backoff of ``decide.retry`` (at once when the spec changes meanwhile)."""
        cluster = f"{self.ref.namespace}/{self.ref.name}"
        self._failures += 1
        failure = ReconcileFailure(isinstance(err, PermanentError), str(err) or repr(err))
        self.state.pass_failed(failure)
        delay = retry_delay(self._failures, failure)
        log.exception("reconcile failed", extra={"cluster": cluster, "retry_in_s": delay, "reason": failure.reason})
        if before is None or before.message != failure.message:
            self.executor.emit(Reason.RECONCILE_FAILED, failure.message[:1024], "Reconcile", EventType.WARNING)
        try:
            await self.reconciler.report_failure()
        except Exception as status_err:  # the API server may be what fails: the log has it, the retry goes on
            log.warning("reconcile failure not in the status", extra={"cluster": cluster, "error": repr(status_err)})
        with contextlib.suppress(TimeoutError):
            await asyncio.wait_for(self._new_generation.wait(), delay)
        self.kick()
