"""What the autoscaler reads from Prometheus expositions (pure): router latency histograms and worker gauges.

The routers' ``tandem_router_ttft_seconds`` and ``tandem_router_inter_token_seconds`` are cumulative histograms;
the p90 of *one interval* is the quantile of the bucket-wise difference of two scrapes, summed over every router
replica (what ``histogram_quantile(0.9, sum by (le) (rate(...[interval])))`` gives in Prometheus, with the same
linear interpolation inside a bucket). The workers' gauges are SGLang 0.5.23's
(``sglang/srt/observability/metrics_collector.py``, ``SchedulerStats`` and ``SchedulerMetricsCollector``):
``num_queue_reqs``, ``token_usage`` (the fullest KV pool, 0-1), ``num_running_reqs``, ``gen_throughput``. SGLang
has no gauge of queued prompt *tokens*; queued requests stand for them. With tenant flow control (the router's
default) the routers hold requests the pairs cannot take yet in their own queues
(``tandem_router_flow_queued_requests{priority}``): demand the workers' gauges do not show, read as well.
"""

from __future__ import annotations

import math
from collections.abc import Iterable, Mapping
from dataclasses import dataclass, field
from typing import TypeVar

from prometheus_client.parser import text_string_to_metric_families

TTFT = "tandem_router_ttft_seconds"
ITL = "tandem_router_inter_token_seconds"
FLOW_QUEUED = "tandem_router_flow_queued_requests"
WORKER_GAUGES = ("sglang:num_queue_reqs", "sglang:token_usage", "sglang:num_running_reqs", "sglang:gen_throughput")

Buckets = Mapping[float, float]  # upper bound ``le`` -> cumulative count
K = TypeVar("K", float, int)


@dataclass(frozen=True)
class RouterScrape:
    """One router's cumulative TTFT and ITL buckets (summed over routes) and the requests waiting in its flow
    control queues by priority, or several routers' summed.

    The routers' in-flight gauge is not read: what they forward is the workers' running + queued requests, which
    the leaders report first-hand; what they hold back (``queued``) no worker sees."""

    ttft: Buckets = field(default_factory=dict)
    itl: Buckets = field(default_factory=dict)
    queued: Mapping[int, float] = field(default_factory=dict)  # effective priority -> requests waiting now


@dataclass(frozen=True)
class WorkerGauges:
    """One group leader's scheduler gauges."""

    queue_reqs: float
    token_usage: float
    running_reqs: float
    gen_throughput: float


def _add(into: dict[K, float], counts: Mapping[K, float]) -> None:
    """Sum ``counts`` into ``into`` key by key (bucket bounds, or priorities)."""
    for key, count in counts.items():
        into[key] = into.get(key, 0.0) + count


def parse_router(text: str) -> RouterScrape:
    """A router's exposition: its histograms summed over routes."""
    histograms: dict[str, dict[float, float]] = {TTFT: {}, ITL: {}}
    queued: dict[int, float] = {}
    for family in text_string_to_metric_families(text):
        if family.name in histograms:
            for sample in family.samples:
                if sample.name == f"{family.name}_bucket":
                    _add(histograms[family.name], {float(sample.labels["le"]): sample.value})
        elif family.name == FLOW_QUEUED:
            for sample in family.samples:
                _add(queued, {int(sample.labels["priority"]): sample.value})
    return RouterScrape(histograms[TTFT], histograms[ITL], queued)


def combine(scrapes: Iterable[RouterScrape]) -> RouterScrape:
    """Every router replica's scrape (or interval) as one."""
    ttft: dict[float, float] = {}
    itl: dict[float, float] = {}
    queued: dict[int, float] = {}
    for scrape in scrapes:
        _add(ttft, scrape.ttft)
        _add(itl, scrape.itl)
        _add(queued, scrape.queued)
    return RouterScrape(ttft, itl, queued)


def parse_worker(text: str) -> WorkerGauges | None:
    """A leader's gauges over its label sets (attention-DP ranks): counts summed, KV usage the fullest; None when
    one is missing."""
    found: dict[str, float] = {}
    for family in text_string_to_metric_families(text):
        if family.name in WORKER_GAUGES and family.samples:
            values = [sample.value for sample in family.samples]
            found[family.name] = max(values) if family.name == "sglang:token_usage" else sum(values)
    if set(found) != set(WORKER_GAUGES):
        return None
    queue, usage, running, throughput = (found[name] for name in WORKER_GAUGES)
    return WorkerGauges(queue, usage, running, throughput)


def interval_buckets(now: Buckets, before: Buckets) -> dict[float, float]:
    """Observations between two scrapes; a counter that went down (a router restarted) counts from zero."""
    delta = {le: count - before.get(le, 0.0) for le, count in now.items()}
    if any(v < 0 for v in delta.values()):
        return dict(now)
    return delta


def quantile(q: float, buckets: Buckets) -> float | None:
    """Prometheus's ``histogram_quantile`` on cumulative buckets; None when nothing was observed.

    Linear interpolation inside the bucket holding the rank; a rank in the ``+Inf`` bucket returns the highest
    finite bound (Prometheus does the same)."""
    ordered = sorted(buckets.items())
    if not ordered or ordered[-1][1] <= 0:
        return None
    rank = q * ordered[-1][1]
    lower_bound, lower_count = 0.0, 0.0
    for le, count in ordered:
        if count >= rank:
            if math.isinf(le):
                return lower_bound
            if count == lower_count:
                return le
            return lower_bound + (le - lower_bound) * (rank - lower_count) / (count - lower_count)
        lower_bound, lower_count = le, count
    return lower_bound
