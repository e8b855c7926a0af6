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
from collections.abc import Callable, Sequence
from dataclasses import dataclass

from tandem.registry import Role
from tandem_router.dispatch import ProxyRequest
from tandem_router.flow_control import FlowControl
from tandem_router.integrity import race_plan
from tandem_router.integrity.monitor import IntegrityMonitor
from tandem_router.integrity.probe_budget import ProbeBudget, ProbeMetrics
from tandem_router.policy.load import WorkerLoad
from tandem_router.pool import Pair, WorkerPool
from tandem_router.probes.canary import CanaryConfig, CanaryProber, ProbeScope
from tandem_router.probes.probation import ProbationMirror, load_target
from tandem_router.probes.race import RaceProber
from tandem_router.probes.shadow import ShadowSampler
from tandem_router.transport import Transport

MIN_KV_USAGE = 0.01  # below this a decode's KV usage says too little to extrapolate its capacity from


@dataclass
class IntegrityHooks:
    monitor: IntegrityMonitor
    shadow: ShadowSampler
    canary: CanaryProber
    mirror: ProbationMirror

    def completed(self, pair: Pair, req: ProxyRequest, outputs: list[str]) -> None:
        suspect = self.monitor.take_suspect(req.request_id)
        comparable = req.parsed.items == 0 and len(outputs) == 1 and req.parsed.deterministic
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
    else an estimate from them (``estimated_capacity``)."""
    learned = None if flow is None else flow.core.capacity
    if learned is not None:
        return float(learned)
    return estimated_capacity([w.load for w in pool.available(Role.DECODE, time.monotonic())])


def estimated_capacity(loads: Sequence[WorkerLoad]) -> float:
    """Requests at once these decodes hold, before flow control learned it (it learns only from saturated decodes,
    which a lightly loaded fleet never has): a decode running requests with ``MIN_KV_USAGE`` or more of its KV in
    use holds ``running / kv_usage`` requests of the mix it runs now; a decode that tells nothing (idle) counts the
    median of those that do, and one when none does. Never below what a decode runs now. (Counting only what the
    decodes ran, the earlier lower bound, held the budget of a 125 x 125 fleet at 14 % of its 1,000 slots.)"""
    seen = sorted(w.running / w.kv_usage for w in loads if w.running > 0 and w.kv_usage >= MIN_KV_USAGE)
    typical = seen[len(seen) // 2] if seen else 1.0
    return sum(
        max(w.running, 1.0, w.running / w.kv_usage if w.running > 0 and w.kv_usage >= MIN_KV_USAGE else typical)
        for w in loads
    )


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
    def weight() -> float:
        return race_plan.budget_weight([w.spec.key for w in pool.of_role(Role.DECODE)], scope.members(), scope.me)

    budget = ProbeBudget(budget_share, capacity, ProbeMetrics(monitor.metrics.registry), weight=weight)

    def pairs() -> list[Pair]:
        return pairs_for_integrity(pool, monitor)

    return IntegrityHooks(
        monitor,
        ShadowSampler(monitor, transport, pool, shadow_rate, budget=budget),
        CanaryProber(
            monitor,
            transport,
            pairs,
            budget,
            scope,
            canary_cfg,
            concurrency=lambda pair: load_target(pool, monitor, pair),
            race=RaceProber(
                monitor,
                transport,
                pairs,
                budget,
                scope.me,
                scope.members,
                min_period_s=canary_cfg.interval_s / race_plan.BURSTS_PER_INTERVAL,
                timeout_s=canary_cfg.timeout_s,
            ),
        ),
        ProbationMirror(monitor, transport, pool),
    )
