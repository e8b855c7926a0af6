"""What the operator makes of one interval's requests (pure): the routers' histograms and Prometheus's p90 estimate.

The decider never sees the requests' p90. Each router counts every TTFT into ``tandem_router_ttft_seconds`` and
every gap between two relayed chunks into ``tandem_router_inter_token_seconds`` (bounds: ``tandem_router.metrics``,
imported here, not copied); the operator differences two scrapes one interval apart and takes
``signals.quantile(0.9, ...)``, which interpolates linearly inside the bucket holding rank 0.9 x count as
Prometheus's ``histogram_quantile`` does (``tandem_operator.autoscale.loop.Autoscaler.routers``). With a few dozen
requests an interval that estimate is noisy, and biased by the buckets' width: a bucket's observations all read as
if spread evenly across it (the routers' bounds are 1.2-1.5x apart around targets; when they were 2.5x apart the
decider never scaled decode down). The bench feeds
the decider this estimate and scores every policy on ``exact_p90_ms`` of the same requests, as a client sees them.
"""

from __future__ import annotations

import math
from bisect import bisect_left
from collections.abc import Sequence

from tandem_operator.autoscale.signals import quantile
from tandem_router.metrics import ITL_BUCKETS, LATENCY_BUCKETS

TTFT_BOUNDS: tuple[float, ...] = tuple(float(b) for b in LATENCY_BUCKETS)
ITL_BOUNDS: tuple[float, ...] = tuple(float(b) for b in ITL_BUCKETS)

# (value in seconds, how many observations of it): a decode step's token gaps come as one entry per step size.
Observed = Sequence[tuple[float, float]]


def cumulative(observed: Observed, bounds: Sequence[float]) -> dict[float, float]:
    """The cumulative ``le`` buckets (``+Inf`` included) a Prometheus histogram with ``bounds`` would expose after
    these observations; ``le`` is inclusive, as in ``prometheus_client``'s ``Histogram.observe``."""
    counts = [0.0] * (len(bounds) + 1)
    for value, n in observed:
        counts[bisect_left(bounds, value)] += n
    out: dict[float, float] = {}
    total = 0.0
    for bound, count in zip((*bounds, math.inf), counts, strict=True):
        total += count
        out[bound] = total
    return out


def estimate_p90_ms(observed: Observed, bounds: Sequence[float]) -> float:
    """The operator's reading of the interval: 0 when nothing was observed (``loop._p90_ms``: idle is a reading)."""
    p90 = quantile(0.9, cumulative(observed, bounds))
    return 0.0 if p90 is None else p90 * 1000


def exact_p90_ms(observed: Observed) -> float | None:
    """The observations' own p90 (nearest rank, weighted by count), as a client timing each request sees it; None
    when there were none."""
    total = sum(n for _, n in observed)
    if total <= 0:
        return None
    rank, seen = 0.9 * total, 0.0
    for value, n in sorted(observed):
        seen += n
        if seen >= rank:
            return value * 1000
    return max(value for value, _ in observed) * 1000
