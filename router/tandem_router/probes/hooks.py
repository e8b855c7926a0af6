"""What happens after a client got a full answer, for integrity: confirm a suspect, sample a shadow, mirror.

The proxy calls ``completed`` once per fully relayed response (its ``on_complete``), after the monitor ran its
detectors on it. A response whose findings wait for a confirmation (``IntegrityMonitor.take_suspect``) is
re-run on two other pairs when it is deterministic, else its pair gets a canary burst. Every deterministic
response of a pair *under suspicion* (it shares a worker with a pair caught by a canary or shadow within the
window) is re-run the same way; any other may be sampled for a shadow comparison. Every response is also
mirrored to the pairs on probation.
"""

from __future__ import annotations

import time
from collections.abc import Callable
from dataclasses import dataclass

from tandem.registry import Role
from tandem_router.dispatch import ProxyRequest
from tandem_router.flow_control import FlowControl
from tandem_router.integrity.monitor import IntegrityMonitor
from tandem_router.integrity.probe_budget import ProbeBudget, ProbeMetrics
from tandem_router.pool import Pair, WorkerPool
from tandem_router.probes.canary import CanaryConfig, CanaryProber, ProbeScope
from tandem_router.probes.probation import ProbationMirror, load_target
from tandem_router.probes.shadow import ShadowSampler, deterministic
from tandem_router.transport import Transport


@dataclass
class IntegrityHooks:
    monitor: IntegrityMonitor
    shadow: ShadowSampler
    canary: CanaryProber
    mirror: ProbationMirror

    def completed(self, pair: Pair, req: ProxyRequest, outputs: list[str]) -> None:
        suspect = self.monitor.take_suspect(req.request_id)
        comparable = req.items == 0 and len(outputs) == 1 and deterministic(req.body)
        if suspect is not None and not (suspect == pair.key and comparable):
            self.canary.confirm_soon(suspect)
        elif comparable and (suspect is not None or self.monitor.under_suspicion(pair.key)):
            self.shadow.confirm(pair, req, outputs[0])
        else:
            self.shadow.completed(pair, req, outputs)
        self.mirror.completed(pair, req, outputs)

    async def drain(self) -> None:
        await self.shadow.drain()
        await self.canary.drain()
        await self.mirror.drain()


def pairs_for_integrity(pool: WorkerPool, monitor: IntegrityMonitor) -> list[Pair]:
    """Every pair the pool can form; tells the monitor the pairs and the workers' epochs first (a recreated
    worker's pairs start clean)."""
    pairs = pool.all_pairs()
    monitor.set_pairs([p.key for p in pairs], {w.spec.key: w.spec.epoch for w in pool.workers.values()})
    return pairs


def probing_capacity(pool: WorkerPool, flow: FlowControl | None) -> float:
    """Requests at once the probing budget is a share of: what flow control learned from the decodes' gauges,
    else a lower bound (each decode that may take traffic runs what it runs now, at least one)."""
    learned = None if flow is None else flow.core.capacity
    if learned is not None:
        return float(learned)
    return sum(max(1.0, w.load.running) for w in pool.available(Role.DECODE, time.monotonic()))


def build_hooks(
    monitor: IntegrityMonitor,
    transport: Transport,
    pool: WorkerPool,
    canary_cfg: CanaryConfig,
    shadow_rate: float,
    *,
    budget_share: float,
    capacity: Callable[[], float],
    scope: ProbeScope,
) -> IntegrityHooks:
    budget = ProbeBudget(budget_share, capacity, ProbeMetrics(monitor.metrics.registry))
    return IntegrityHooks(
        monitor,
        ShadowSampler(monitor, transport, pool, shadow_rate, budget=budget),
        CanaryProber(
            monitor,
            transport,
            lambda: pairs_for_integrity(pool, monitor),
            budget,
            scope,
            canary_cfg,
            concurrency=lambda pair: load_target(pool, monitor, pair),
        ),
        ProbationMirror(monitor, transport, pool),
    )
