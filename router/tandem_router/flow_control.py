"""Tenant flow control in the request path: the thin async adapter around the pure core (``flow.fair``).

``enter`` offers a request to the core and, when it is queued, waits for its turn (at most the tenant's
``queue_timeout_s``); ``leave`` releases its slot and wakes whoever the core lets in. ``run`` ticks in the
background: the capacity learned from the decodes' scraped gauges (``flow.capacity``), and the limits file,
reloaded when it changes (its mtime, inode or size: a Kubernetes ConfigMap update swaps a symlink). A malformed file
is refused, logged with the field it names and counted, and the last good limits stay.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import math
import os
import time
from collections.abc import Iterator
from pathlib import Path

from prometheus_client import CollectorRegistry
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily, HistogramMetricFamily, Metric
from prometheus_client.registry import Collector

from tandem.registry import Role
from tandem_router.config import RouterSettings
from tandem_router.flow.capacity import CapacityLearner
from tandem_router.flow.fair import FairQueue, Pending, Reason, Rejection
from tandem_router.flow.limits import FlowLimits, LimitsError, load_limits
from tandem_router.openai.schema import ErrorType, error_body
from tandem_router.pool import WorkerPool
from tandem_router.server import Reply

log = logging.getLogger("tandem.router.flow")

TICK_S = 0.5
OTHER = "other"


class FlowControl:
    def __init__(self, settings: RouterSettings, pool: WorkerPool, registry: CollectorRegistry) -> None:
        self.pool = pool
        flow = settings.flow_control
        self.path = flow.limits_file
        self._stamp: tuple[int, int, int] | None = None
        limits = FlowLimits()
        if self.path is not None:
            self._stamp = _stamp(self.path)
            limits = load_limits(self.path)  # main checked it: a one-line error naming the setting
        self.core = FairQueue(limits, flow.reserve_share, flow.headroom_share, flow.share_linger_s)
        self.learner = CapacityLearner()
        self._waiting: dict[Pending, asyncio.Future[None]] = {}
        self.counts = _TenantCounts(flow.metrics_tenants)
        self.reloads = {"ok": 0, "refused": 0}
        registry.register(_FlowCollector(self))

    async def enter(self, tenant: str, priority: int | None, cost: float) -> Pending | Reply:
        """The request's slot (``Pending``, admitted), or the 429 that refuses it."""
        verdict = self.core.offer(tenant, priority, cost, time.monotonic())
        if isinstance(verdict, Rejection):
            return self._refuse(tenant, verdict)
        if not verdict.admitted:
            waited = await self._wait(verdict)
            if waited is not None:
                return waited
        self.counts.admitted(tenant)
        return verdict

    def leave(self, p: Pending) -> None:
        self._wake(self.core.release(p, time.monotonic()))

    async def _wait(self, p: Pending) -> Reply | None:
        future = asyncio.get_running_loop().create_future()
        self._waiting[p] = future
        started = time.monotonic()
        try:
            async with asyncio.timeout(p.timeout_s):
                await future
        except TimeoutError:
            if not p.admitted:
                self.core.cancel(p)
                self.counts.queue_wait(time.monotonic() - started)
                return self._refuse(
                    p.tenant,
                    Rejection(Reason.QUEUE_TIMEOUT, 1.0, f"not admitted within the queue deadline ({p.timeout_s:g}s)"),
                )
        except asyncio.CancelledError:
            if p.admitted:
                self.leave(p)  # let in as its client left: the slot goes to the next one
            else:
                self.core.cancel(p)
            raise
        finally:
            self._waiting.pop(p, None)
        self.counts.queue_wait(time.monotonic() - started)
        return None

    def _wake(self, admitted: list[Pending]) -> None:
        for p in admitted:
            future = self._waiting.pop(p, None)
            if future is not None and not future.done():
                future.set_result(None)

    def _refuse(self, tenant: str, why: Rejection) -> Reply:
        self.counts.rejected(tenant, why.reason)
        retry_after = str(max(1, math.ceil(why.retry_after_s)))
        body = error_body(f"rate limited: {why.message}; retry later", ErrorType.RATE_LIMIT, code=why.reason.value)
        return Reply(body, status=429, headers=(("Retry-After", retry_after),))

    # -- background: capacity and limits --------------------------------------------------------------------
    async def run(self, stop: asyncio.Event) -> None:
        while not stop.is_set():
            try:
                self.tick(time.monotonic())
            except Exception:
                log.exception("flow control tick failed")
            with contextlib.suppress(TimeoutError):
                await asyncio.wait_for(stop.wait(), TICK_S)

    def tick(self, now: float) -> None:
        decodes = self.pool.of_role(Role.DECODE)
        for w in decodes:
            self.learner.sample(w.spec.key, w.load)
        self.learner.forget_except(w.spec.key for w in decodes)
        available = [w.spec.key for w in self.pool.available(Role.DECODE, now)]
        self._wake(self.core.expire(now))
        self._wake(self.core.set_capacity(self.learner.capacity(available)))
        self.reload()

    def reload(self) -> None:
        if self.path is None:
            return
        stamp = _stamp(self.path)
        if stamp == self._stamp:
            return
        self._stamp = stamp
        try:
            limits = load_limits(self.path)
        except LimitsError as err:
            self.reloads["refused"] += 1
            log.error("flow limits file refused; the last good limits stay", extra={"error": str(err)})
            return
        self.reloads["ok"] += 1
        self._wake(self.core.set_limits(limits))
        log.info("flow limits reloaded", extra={"file": str(self.path), "tenants": len(limits.tenants)})


def _stamp(path: Path) -> tuple[int, int, int] | None:
    try:
        st = os.stat(path)  # follows the symlink a ConfigMap swaps
    except OSError:
        return None
    return (st.st_mtime_ns, st.st_ino, st.st_size)


class _TenantCounts:
    """Per-tenant counters with bounded label cardinality: the first ``size`` tenants seen keep a series of their
    own (for good: a counter never moves between series), every other tenant counts as ``other``."""

    BUCKETS = (0.001, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1, 2.5, 5, 10, 30, 60)

    def __init__(self, size: int) -> None:
        self.size = size
        self.labels: dict[str, str] = {}
        self.admits: dict[str, int] = {}
        self.rejects: dict[tuple[str, str], int] = {}
        self.waits = [0] * (len(self.BUCKETS) + 1)
        self.wait_sum = 0.0

    def label(self, tenant: str) -> str:
        label = self.labels.get(tenant)
        if label is None:
            label = tenant if len(self.labels) < self.size else OTHER
            if label != OTHER:
                self.labels[tenant] = label
        return label

    def admitted(self, tenant: str) -> None:
        label = self.label(tenant)
        self.admits[label] = self.admits.get(label, 0) + 1

    def rejected(self, tenant: str, reason: Reason) -> None:
        key = (self.label(tenant), reason.value)
        self.rejects[key] = self.rejects.get(key, 0) + 1

    def queue_wait(self, seconds: float) -> None:
        i = next((n for n, b in enumerate(self.BUCKETS) if seconds <= b), len(self.BUCKETS))
        self.waits[i] += 1
        self.wait_sum += seconds


class _FlowCollector(Collector):
    """Flow control's series, read at scrape time (no per-request cost beyond two dict updates)."""

    def __init__(self, flow: FlowControl) -> None:
        self.flow = flow

    def collect(self) -> Iterator[Metric]:
        f, core = self.flow, self.flow.core
        yield GaugeMetricFamily(
            "tandem_router_flow_capacity_requests",
            "Requests the available decodes run at once, learned from their gauges (NaN: not learned yet).",
            value=math.nan if core.capacity is None else core.capacity,
        )
        yield GaugeMetricFamily("tandem_router_flow_in_flight_requests", "Requests admitted.", value=core.in_flight)
        queued = GaugeMetricFamily(
            "tandem_router_flow_queued_requests",
            "Requests waiting in the router's tenant queues, by effective priority (demand the pairs do not "
            "serve yet: an autoscaling signal).",
            labels=["priority"],
        )
        for priority, n in sorted(core.queued_by_priority().items()):
            queued.add_metric([str(priority)], n)
        yield queued
        yield from self._tenants()
        admitted = CounterMetricFamily(
            "tandem_router_flow_admitted_requests", "Requests admitted, by tenant.", labels=["tenant"]
        )
        for label, n in f.counts.admits.items():
            admitted.add_metric([label], n)
        yield admitted
        rejected = CounterMetricFamily(
            "tandem_router_flow_rejected_requests",
            "Requests answered 429 by flow control, by tenant and reason.",
            labels=["tenant", "reason"],
        )
        for (label, reason), n in f.counts.rejects.items():
            rejected.add_metric([label, reason], n)
        yield rejected
        reloads = CounterMetricFamily(
            "tandem_router_flow_limits_reloads", "Limits file reloads, by result (ok, refused).", labels=["result"]
        )
        for result, n in f.reloads.items():
            reloads.add_metric([result], n)
        yield reloads
        yield self._waits()

    def _tenants(self) -> Iterator[GaugeMetricFamily]:
        """The busiest tenants now (in flight + queued) by name, the rest summed as ``other``."""
        core, size = self.flow.core, self.flow.counts.size
        busy = sorted(core.tenants.values(), key=lambda t: -(t.in_flight + len(t.queue)))
        busy = [t for t in busy if t.busy]
        in_flight = GaugeMetricFamily(
            "tandem_router_flow_tenant_in_flight_requests", "Requests admitted, by tenant.", labels=["tenant"]
        )
        waiting = GaugeMetricFamily(
            "tandem_router_flow_tenant_queued_requests", "Requests queued, by tenant.", labels=["tenant"]
        )
        rest = [0, 0]
        for n, t in enumerate(busy):
            if n < size:
                in_flight.add_metric([t.name], t.in_flight)
                waiting.add_metric([t.name], len(t.queue))
            else:
                rest[0] += t.in_flight
                rest[1] += len(t.queue)
        if len(busy) > size:
            in_flight.add_metric([OTHER], rest[0])
            waiting.add_metric([OTHER], rest[1])
        yield in_flight
        yield waiting

    def _waits(self) -> HistogramMetricFamily:
        counts = self.flow.counts
        buckets: list[tuple[str, float]] = []
        total = 0
        for bound, n in zip((*counts.BUCKETS, math.inf), counts.waits, strict=True):
            total += n
            buckets.append(("+Inf" if bound == math.inf else repr(float(bound)), total))
        return HistogramMetricFamily(
            "tandem_router_flow_queue_wait_seconds",
            "Time queued requests waited for admission (or for their 429).",
            buckets=buckets,
            sum_value=counts.wait_sum,
        )
