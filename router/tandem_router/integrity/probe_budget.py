"""The probing budget: canaries, bursts, confirmations and race bursts use at most ``share`` of the cluster's
capacity together.

Capacity is counted in requests at once (what the decodes run together), so the budget is in *request-seconds per
second*: a probe that takes 0.8 s holds one of the cluster's request slots for 0.8 s. With ``share`` 1 % and 1,000
slots, probing may keep 10 requests in flight on average. A token bucket holds the allowance: it fills at
``share x capacity`` request-seconds a second and holds at most ``depth_s`` seconds of it (and at least
``MIN_PROBES`` probes, the smallest round with a majority, so a small cluster still probes, just rarely). Each
probe reserves the current estimate of a probe's duration before it is sent and settles with what it really took.
What is not granted is not sent: a round is cut from its end (the plan puts suspects first), a burst is made
smaller.

A probe's time is the time it held a decode's slot: the decode's own time over it where the worker says (SGLang's
``meta_info.e2e_latency`` on ``/generate``, from the request's arrival at the decode to its end, which covers the
wait for the prefill and the KV transfer), never more than the router's; the router's own time otherwise. A busy
router's event loop stretches its own count of a probe (2.6 s a probe against the workers' 0.4 s in a 125 x 125
fleet sharing 2 cores), and paying the budget with that would probe a sixth of what the share allows.

Shadows and probation mirrors are not counted here: they re-run a share of live traffic (``--shadow-rate``) or
mirror it to pairs on probation, so they scale with the traffic, not with the fleet.

The routers of a cluster split the one budget: each router's bucket fills at ``share x capacity x weight``, where
``weight`` (from outside) is its share of the probing work, the decodes whose race bursts it sends
(``race_plan.budget_weight``); the weights of a cluster's routers sum to 1, so adding routers adds no probing.

The capacity comes from outside (``capacity()``): the capacity flow control learned from the decodes' gauges when
known, else an estimate from the decodes' gauges (``probes.hooks.probing_capacity``).
"""

from __future__ import annotations

import math
import time
from collections.abc import Callable
from enum import StrEnum

from prometheus_client import CollectorRegistry, Counter, Gauge

from tandem_router.integrity.divergence import Answer

DEPTH_S = 60.0  # at most this many seconds of allowance saved up
FIRST_GUESS_S = 1.0  # a probe's duration before one was measured
SMOOTHING = 0.2  # weight of the newest measured duration
MIN_PROBES = 3  # the bucket holds at least this many probes: three answers have a majority without a reference


def held_s(answer: Answer | None, router_s: float) -> float:
    """Seconds a probe held a decode's slot: the worker's own time over ``answer`` when it reported one, at most the
    router's ``router_s``."""
    return router_s if answer is None or answer.worker_s is None else min(answer.worker_s, router_s)


class ProbeKind(StrEnum):
    CANARY = "canary"  # rotation rounds
    BURST = "burst"  # concurrent canaries through a pair on probation, or staggered through a decode (``race_plan``)
    CONFIRMATION = "confirmation"  # a burst that confirms a detector finding


class ProbeMetrics:
    def __init__(self, registry: CollectorRegistry) -> None:
        self.probes = Counter(
            "tandem_integrity_probes",
            "Probe requests sent (canaries, bursts, confirmations).",
            ["kind"],
            registry=registry,
        )
        self.seconds = Counter(
            "tandem_integrity_probe_seconds", "Request-seconds the probes took, by kind.", ["kind"], registry=registry
        )
        self.denied = Counter(
            "tandem_integrity_probes_denied",
            "Probes not sent: over the probing budget, by kind.",
            ["kind"],
            registry=registry,
        )
        self.budget = Gauge(
            "tandem_integrity_probe_budget_requests",
            "Requests at once this router's probing budget allows on average (share x capacity x its weight).",
            registry=registry,
        )
        self.capacity = Gauge(
            "tandem_integrity_probe_capacity_requests",
            "Requests at once the cluster runs, as the probing budget counts it (learned, else a lower bound).",
            registry=registry,
        )


class ProbeBudget:
    def __init__(
        self,
        share: float,
        capacity: Callable[[], float],
        metrics: ProbeMetrics,
        clock: Callable[[], float] = time.monotonic,
        depth_s: float = DEPTH_S,
        weight: Callable[[], float] = lambda: 1.0,
    ) -> None:
        self.share, self.capacity, self.metrics, self.clock, self.depth_s = share, capacity, metrics, clock, depth_s
        self.weight = weight
        self.expected_s = FIRST_GUESS_S
        self._rate = 0.0
        self._tokens = 0.0
        self._at: float | None = None

    def _refill(self) -> None:
        now = self.clock()
        slots = max(0.0, self.capacity())
        self._rate = self.share * slots * max(0.0, self.weight())
        self.metrics.capacity.set(slots)
        self.metrics.budget.set(self._rate)
        # A router without a share of the work (weight 0) gets no floor either: its floor would be probing on top.
        depth = max(self._rate * self.depth_s, MIN_PROBES * self.expected_s) if self._rate > 0 else 0.0
        if self._at is None:
            self._tokens = depth  # a new router may probe one full allowance at once
        else:
            self._tokens = min(depth, self._tokens + self._rate * (now - self._at))
        self._at = now

    def grant(self, kind: ProbeKind, wanted: int) -> int:
        """How many of ``wanted`` probes may go now; their expected time is reserved."""
        if wanted <= 0:
            return 0
        self._refill()
        granted = min(wanted, max(0, math.floor(self._tokens / self.expected_s + 1e-9)))
        self._tokens -= granted * self.expected_s
        if granted < wanted:
            self.metrics.denied.labels(kind.value).inc(wanted - granted)
        self.metrics.probes.labels(kind.value).inc(granted)
        return granted

    def refresh(self) -> None:
        """Refill now: the gauges follow the capacity and the weight even while nothing is asked of the budget."""
        self._refill()

    def wait_s(self, probes: int) -> float:
        """Seconds until ``probes`` probes are affordable (at the current rate and estimate; inf at rate 0)."""
        self._refill()
        short = probes * self.expected_s - self._tokens
        if short <= 0:
            return 0.0
        return short / self._rate if self._rate > 0 else math.inf

    def affordable(self) -> int:
        """How many probes ``grant`` would grant now (nothing reserved): for probes that are worth sending only
        together."""
        self._refill()
        return max(0, math.floor(self._tokens / self.expected_s + 1e-9))

    def settle(self, kind: ProbeKind, reserved_s: float, took_s: float) -> None:
        """A granted probe, for which ``reserved_s`` was reserved (``expected_s`` when it was granted), is over
        after ``took_s``: the bucket pays the difference, and the estimate of a probe's duration moves towards it."""
        self._tokens += reserved_s - took_s
        self.expected_s += SMOOTHING * (max(took_s, 0.001) - self.expected_s)
        self.metrics.seconds.labels(kind.value).inc(took_s)
