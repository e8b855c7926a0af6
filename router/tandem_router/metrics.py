"""Prometheus metrics, all prefixed ``tandem_router_``, in a registry per router instance (tests run several), beside
the process's own that every Prometheus Python exporter has: ``process_*`` (CPU seconds, resident memory, open file
descriptors) and ``python_gc_*`` (collections per generation: what ``main.GC_THRESHOLDS`` keeps rare)."""

from __future__ import annotations

import time
from collections.abc import Iterator
from typing import Generic, TypeVar

from prometheus_client import CollectorRegistry, Counter, GCCollector, Histogram, ProcessCollector
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily
from prometheus_client.metrics import MetricWrapperBase
from prometheus_client.registry import Collector

from tandem.registry import Role
from tandem.registry_versions import SCHEMA_VERSION, Refusal, SchemaCensus
from tandem_router.openai.schema import Route
from tandem_router.policy.breaker import BreakerState
from tandem_router.pool import Pair, WorkerPool
from tandem_router.registry_guard import RegistryGuard

# Fine (bounds 1.2-1.5x apart) where SLO targets and the autoscaler's scale-down thresholds (``scaleDownBelow`` x
# target) sit: TTFT 0.25-10 s, gaps 10-250 ms. ``histogram_quantile`` interpolates inside a bucket, so an interval whose
# requests all fall in one wide bucket reads near its upper bound: with the former (20, 50] ms gap bucket every
# ITL p90 read ~47 ms and a 60 ms target's 30 ms scale-down threshold was never crossed (``tandem bench autoscale``).
LATENCY_BUCKETS = (0.0005, 0.001, 0.002, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.375, 0.5, 0.625, 0.75, 1, 1.25, 1.5,
                    2, 2.5, 3, 4, 5, 7.5, 10, 30, 60, 300)  # fmt: skip
ITL_BUCKETS = (0.0002, 0.0005, 0.001, 0.002, 0.005, 0.01, 0.0125, 0.015, 0.02, 0.025, 0.03, 0.04, 0.05, 0.06, 0.075,
                0.1, 0.125, 0.15, 0.2, 0.25, 0.5, 1, 5)  # fmt: skip
M = TypeVar("M", bound=MetricWrapperBase)


class Children(Generic[M]):
    """A labelled metric's children by label values, each resolved once: ``labels`` validates, converts and takes
    a lock on every call, which per request (and per stream event) is a measurable share of the router's CPU.
    A child is created on first use, as with ``labels``, so no empty series appears before its first sample."""

    def __init__(self, metric: M) -> None:
        self.metric = metric
        self._children: dict[tuple[str, ...], M] = {}

    def __call__(self, *values: str) -> M:
        child = self._children.get(values)
        if child is None:
            child = self._children[values] = self.metric.labels(*values)
        return child


class RouterMetrics:
    def __init__(self, pool: WorkerPool) -> None:
        self.registry = CollectorRegistry()
        r = self.registry
        ProcessCollector(registry=r)
        GCCollector(registry=r)
        self.requests = Counter(
            "tandem_router_requests", "Requests by route and HTTP status.", ["route", "status"], registry=r
        )
        self.ttft = Histogram(
            "tandem_router_ttft_seconds",
            "Time to first byte relayed to the client.",
            ["route"],
            buckets=LATENCY_BUCKETS,
            registry=r,
        )
        self.itl = Histogram(
            "tandem_router_inter_token_seconds",
            "Time between two relayed stream chunks.",
            ["route"],
            buckets=ITL_BUCKETS,
            registry=r,
        )
        self.e2e = Histogram(
            "tandem_router_e2e_seconds",
            "Request arrival to last byte.",
            ["route"],
            buckets=LATENCY_BUCKETS,
            registry=r,
        )
        self.retries = Counter(
            "tandem_router_retries", "Retries on another pair, by reason.", ["route", "reason"], registry=r
        )
        self.pair_failures = Counter(
            "tandem_router_pair_failures",
            "Failed attempts per (prefill, decode) pair.",
            ["prefill", "decode", "reason"],
            registry=r,
        )
        self.stream_errors = Counter(
            "tandem_router_stream_errors",
            "Streams ended with an error event after the first byte.",
            ["route"],
            registry=r,
        )
        self.resumed = Counter(
            "tandem_router_resumed_streams",
            "Streams resumed on a fresh pair after the first byte, by route and what broke the last pair.",
            ["route", "reason"],
            registry=r,
        )
        self.resume_refused = Counter(
            "tandem_router_resume_refused",
            "Streams that broke after the first byte and were not resumed, by route and why (resume.Refusal codes).",
            ["route", "reason"],
            registry=r,
        )
        self.resume_gap = Histogram(
            "tandem_router_resume_gap_seconds",
            "The pause a resumed stream's client saw: the break to the fresh pair's first chunk.",
            buckets=LATENCY_BUCKETS,
            registry=r,
        )
        self.pairs = Counter(
            "tandem_router_pair_dispatches",
            "Requests dispatched per pair of prefill and decode compatibility revisions (mixed: never).",
            ["prefill_revision", "decode_revision"],
            registry=r,
        )
        self.fabric_refusals = Counter(
            "tandem_router_fabric_refused_requests",
            "Requests answered 503 because the fabric mode required a pair within one RDMA fabric domain and none "
            "was available (pairs across domains were).",
            ["route"],
            registry=r,
        )
        r.register(_PoolCollector(pool))
        # The series every request touches, by route (and revisions): resolved once.
        self.route_requests = Children(self.requests)
        self.route_ttft = Children(self.ttft)
        self.route_itl = Children(self.itl)
        self.route_e2e = Children(self.e2e)
        self._pair_dispatches = Children(self.pairs)

    def dispatched(self, pair: Pair) -> None:
        self._pair_dispatches(pair.prefill.revision, pair.decode.revision).inc()

    def fabric_refused(self, route: Route) -> None:
        self.fabric_refusals.labels(route.value).inc()

    def pair_failure(self, pair: Pair, reason: str) -> None:
        self.pair_failures.labels(pair.prefill.url, pair.decode.url, reason).inc()


class _PoolCollector(Collector):
    """In-flight requests and breaker state per worker, read from the pool at scrape time (no per-request cost)."""

    def __init__(self, pool: WorkerPool) -> None:
        self.pool = pool

    def collect(self) -> Iterator[GaugeMetricFamily | CounterMetricFamily]:
        in_flight = GaugeMetricFamily(
            "tandem_router_worker_in_flight", "Requests in flight per worker.", labels=["role", "worker"]
        )
        up = GaugeMetricFamily(
            "tandem_router_worker_available",
            "1 if the worker's circuit breaker admits traffic.",
            labels=["role", "worker"],
        )
        now = time.monotonic()
        for w in self.pool.workers.values():
            labels = [w.spec.role.value, w.spec.url]
            in_flight.add_metric(labels, w.in_flight)
            up.add_metric(
                labels,
                1.0
                if w.breaker.state is BreakerState.CLOSED or w.breaker.opened_at + w.breaker.cooldown <= now
                else 0.0,
            )
        yield in_flight
        yield up
        yield CounterMetricFamily(
            "tandem_router_mooncake_session_reuses",
            "Recreated groups registered under a Mooncake session id an earlier incarnation of theirs held.",
            value=self.pool.mooncake_session_reuses,
        )
        yield CounterMetricFamily(
            "tandem_router_registry_forged_endpoints",
            "Registry values ignored because they lack a valid operator signature (--registry-verify-key).",
            value=self.pool.forged_endpoints,
        )
        choices = CounterMetricFamily(
            "tandem_router_fabric_pair_choices",
            "Pairs chosen (client requests, retries, resumed streams, shadows) by where their workers are: same "
            "fabric domain, cross (two domains), unknown (a worker without a domain).",
            labels=["locality"],
        )
        for where, count in self.pool.fabric_choices.items():
            choices.add_metric([where.value], count)
        yield choices
        yield _available_pairs(self.pool, now)
        if self.pool.registry_guard is not None:
            yield from _registry_guard(self.pool.registry_guard)
        if self.pool.registry_census is not None:
            yield from _registry_schemas(self.pool.registry_census)


def _registry_schemas(census: SchemaCensus) -> Iterator[GaugeMetricFamily | CounterMetricFamily]:
    """Registry entries by how their schema version relates to the router's (``tandem.registry_versions``)."""
    entries = GaugeMetricFamily(
        "tandem_router_registry_entries_by_schema",
        f"Registry entries of the router's cluster by schema version relative to the router's ({SCHEMA_VERSION}): "
        "older (one back), current, newer (one ahead: used, unknown members ignored), unsupported (refused: two or "
        "more ahead, too old, or invalid; its worker is left out).",
        labels=["relation"],
    )
    for relation, count in census.counts().items():
        entries.add_metric([relation.value], count)
    yield entries
    refused = CounterMetricFamily(
        "tandem_router_registry_refused_entries",
        "Registry values refused (each read: a put, or a re-listing), by reason: too_new, too_old, invalid.",
        labels=["reason"],
    )
    for reason in Refusal:
        refused.add_metric([reason.value], census.refused[reason])
    yield refused


def _registry_guard(guard: RegistryGuard) -> Iterator[GaugeMetricFamily | CounterMetricFamily]:
    """The etcd registry's removal-storm guard (``registry_guard``): whether it holds workers now, and how often."""
    yield GaugeMetricFamily(
        "tandem_router_registry_panic",
        "1 while a registry removal storm is held: workers the registry removed keep serving while healthy.",
        value=1.0 if guard.panicking else 0.0,
    )
    yield GaugeMetricFamily(
        "tandem_router_registry_held_workers",
        "Workers the registry removed in a storm that the router keeps routing to (their health checks pass).",
        value=len(guard.held),
    )
    yield CounterMetricFamily(
        "tandem_router_registry_panics", "Registry removal storms the router held.", value=guard.panics
    )
    yield CounterMetricFamily(
        "tandem_router_registry_held_released",
        "Held workers removed after all: their checks failed, or the registry settled without them.",
        value=guard.released,
    )


def _available_pairs(pool: WorkerPool, now: float) -> GaugeMetricFamily:
    """Pairs the router may choose now, by revision: during a rollout, one series per revision."""
    pairs = GaugeMetricFamily(
        "tandem_router_pairs",
        "Prefill/decode pairs the router may choose, by compatibility revision.",
        labels=["revision"],
    )
    counts: dict[str, int] = {}
    for p in pool.available(Role.PREFILL, now):
        for d in pool.available(Role.DECODE, now):
            if pool.can_pair(p.spec, d.spec):
                counts[p.spec.revision] = counts.get(p.spec.revision, 0) + 1
    for revision, count in sorted(counts.items()):
        pairs.add_metric([revision], count)
    return pairs
