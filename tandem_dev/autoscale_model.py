"""The autoscale bench's model of one cluster (pure but for a seeded generator): latency distributions and gauges.

A model, not a measurement. Groups serve with the simulator's ``kimi-k2.6-h200`` profile (``tandem_sim.model.profiles``:
prefill ``per_token`` x prompt, decode step ``base + (per_seq + per_kv_token x context) x batch``); the load spreads
evenly over the ready groups of each role. One second at a time:

- **prefill**, an M/D/1 queue per group: service ``s`` = prompt x ``prefill_ms_per_token``, load ``rho = rate x s``,
  Pollaczek-Khinchine mean wait ``W = rho s / (2 (1 - rho))``. A request waits 0 with probability ``1 - rho``,
  otherwise an exponential time of mean ``W / rho`` (the exponential tail of the M/D/1 wait, matched to its mean);
  its TTFT is ``s`` + that wait + one mean decode step. A group's requests in system at a scrape follow the
  same approximation (0 with probability ``1 - rho``, else 1 + a geometric number of mean ``rho / (2 (1 - rho))``,
  so the waiting ones average ``rho^2 / (2 (1 - rho))``, Little's law on ``W``); ``sglang:num_queue_reqs`` is the
  waiting ones.
- **decode**: the running batch of a group is Poisson (M/G/inf occupancy) with the mean of Little's law at the mean
  step, ``B = rate x output x step`` with ``step = base + b B``, so ``step = base / (1 - b rate output)``. Each
  second each group draws its batch, steps at ``base + b x batch`` and relays ``batch x 1000 / step`` token gaps of
  that length; ``sglang:num_running_reqs`` is the batch, ``sglang:token_usage`` ``batch x context / KV_TOKENS``.

A role at load >= ``SATURATION`` reads ``SATURATED_MS`` for every request or gap and ``SATURATED_QUEUE`` waiting per
group. Arrivals are Poisson; every draw comes from a generator seeded by the caller, so a run is deterministic.
Not modelled: queues carried over a scale change (a new group starts empty, a removed one's queue vanishes),
correlation of the queue or the batch across seconds, jitter of a step beyond its batch size.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import numpy as np

from tandem_sim.model.profiles import PROFILES

PROFILE = PROFILES["kimi-k2.6-h200"]
PROMPT, OUTPUT = 4096, 500  # tokens per request
CONTEXT = PROMPT + OUTPUT // 2  # mean context of a running sequence
KV_TOKENS = 500_000  # KV slots per decode group
SATURATION = 0.98
SATURATED_MS = 60_000.0
SATURATED_QUEUE = 50
PER_SEQ_MS = PROFILE.decode_ms_per_seq + PROFILE.decode_ms_per_kv_token * CONTEXT  # one running sequence's share


@dataclass(frozen=True)
class Conditions:
    """One second's load on the ready groups."""

    rate: float  # requests per second
    prefill_groups: int
    decode_groups: int
    service_s: float  # one prompt's prefill
    rho: float  # prefill load per group
    step_ms: float  # mean decode step (SATURATED_MS when saturated)
    batch: float  # mean running sequences per decode group

    @property
    def prefill_saturated(self) -> bool:
        return self.prefill_groups == 0 or self.rho >= SATURATION

    @property
    def decode_saturated(self) -> bool:
        return self.step_ms >= SATURATED_MS


def conditions(rate: float, prefill: int, decode: int) -> Conditions:
    s = PROFILE.prefill_s(PROMPT)
    rho = rate / max(prefill, 1) * s
    per_group = rate / max(decode, 1)
    load = PER_SEQ_MS / 1000 * per_group * OUTPUT
    if decode == 0 or load >= SATURATION:
        return Conditions(rate, prefill, decode, s, rho, SATURATED_MS, KV_TOKENS / CONTEXT)
    step = PROFILE.decode_base_ms / (1 - load)
    return Conditions(rate, prefill, decode, s, rho, step, per_group * OUTPUT * step / 1000)


def _poisson_quantile(q: float, mean: float) -> int:
    k, p = 0, math.exp(-mean)
    total = p
    while total < q:
        k += 1
        p *= mean / k
        total += p
    return k


def model_p90_ms(c: Conditions) -> tuple[float, float]:
    """The p90s of the distributions ``sample_second`` draws from (TTFT, token gap), for sizing the fixed row."""
    itl = SATURATED_MS
    if not c.decode_saturated:
        # a gap's batch is size-biased: a sequence sees a batch of 1 + Poisson(mean) (its own and the others)
        itl = PROFILE.decode_base_ms + PER_SEQ_MS * (1 + _poisson_quantile(0.9, c.batch))
    if c.prefill_saturated:
        return SATURATED_MS, itl
    wait = c.service_s / (2 * (1 - c.rho)) * math.log(10 * c.rho) if c.rho > 0.1 else 0.0
    return (c.service_s + wait) * 1000 + min(c.step_ms, SATURATED_MS), itl


@dataclass(frozen=True)
class Second:
    """One second's draws: its requests' TTFTs, the token gaps relayed, and each ready group's gauges."""

    ttft_s: list[float]
    gaps: list[tuple[float, float]]  # (step in seconds, token gaps of that length)
    prefill_in_system: list[int]  # per prefill group: waiting + the one in service
    decode_running: list[int]  # per decode group
    decode_waiting: float = 0.0  # summed over the decode groups

    @property
    def prefill_waiting(self) -> float:
        return float(sum(max(n - 1, 0) for n in self.prefill_in_system))

    @property
    def token_usage(self) -> float:
        return min(1.0, max(self.decode_running, default=0) * CONTEXT / KV_TOKENS)

    @property
    def gen_throughput(self) -> float:
        return sum(n for _, n in self.gaps)


def sample_second(rng: np.random.Generator, c: Conditions, arrivals: int) -> Second:
    step_s = min(c.step_ms, SATURATED_MS) / 1000
    if c.prefill_saturated:
        ttft = [SATURATED_MS / 1000] * arrivals
        in_system = [SATURATED_QUEUE + 1] * c.prefill_groups
    else:
        tail = c.service_s / (2 * (1 - c.rho))  # mean wait of a request that waits
        waits = np.where(rng.random(arrivals) < c.rho, rng.exponential(tail, arrivals), 0.0)
        ttft = [c.service_s + float(w) + step_s for w in waits]
        extra = c.rho / (2 * (1 - c.rho))
        busy = rng.random(c.prefill_groups) < c.rho
        queued = rng.geometric(1 / (1 + extra), c.prefill_groups)  # >= 1: the one in service and those waiting
        in_system = [int(q) if b else 0 for b, q in zip(busy, queued, strict=True)]
    if c.decode_saturated:
        full = int(KV_TOKENS // CONTEXT)
        gaps = [(step_s, 1.0)] * c.decode_groups
        return Second(ttft, gaps, in_system, [full] * c.decode_groups, float(SATURATED_QUEUE * c.decode_groups))
    batches = [int(b) for b in rng.poisson(c.batch, c.decode_groups)]
    gaps = []
    for batch in batches:
        step_ms = PROFILE.decode_base_ms + PER_SEQ_MS * batch
        if batch:
            gaps.append((step_ms / 1000, float(round(batch * 1000 / step_ms))))
    return Second(ttft, gaps, in_system, batches)
