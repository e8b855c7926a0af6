"""Probation: live requests mirrored to quarantined pairs at the pool's live concurrency, answers compared.

A pair on probation serves no client. The live requests that trusted pairs answered in full (the last 256) are
replayed to it in a closed loop that keeps its mirrored requests in flight at its target (``mirror_targets``:
each of its workers carries what a serving worker of its role carries), so the pair carries the load it would
carry if it served: races that need load (the decode KV-offload slot reuse) show here, not in front of clients.
Deterministic requests (temperature 0 or a seed) are mirrored as a copy that asks for the top-two logprobs and
compared with the text the client got (``integrity.divergence``): SAME is a clean comparison; DIFFERENT is re-run
on a third, trusted pair and counts against the pair on probation only when that third pair's answer agrees with
the client's text (SAME or NUMERICAL) and is DIFFERENT from the mirrored one; without a third pair, or when it
settles nothing, the pair is not proven clean either: its streak of clean comparisons restarts.
Non-deterministic requests are mirrored for the load only. ``comparisons_to_release`` clean comparisons in a row
release the pair (``integrity.quarantine``).

Probation must release a clean pair under batch-variant numerics (SGLang without
``--enable-deterministic-inference``: a near-tied token flips with the batch, and the answer diverges from there)
and never a garbling one. A NUMERICAL answer proves the pair clean only as far as it agreed: what follows the flip
is not compared. So it counts as a clean comparison only when at least ``min_agreed_tokens`` (8,
``divergence.MIN_AGREED_TOKENS``) tokens agreed before the flip; an earlier flip counts neither way (not clean,
not a mismatch: the streak is kept). Why a prefix: in PD the first output token is computed by the prefill (it
is handed to the decode with the KV), so a flip at token 0 says nothing about the decode's data path, where the
offload races live; from the second token on every decode step attends over the transferred KV. Why 8: an agreed
prefix of 8 tokens means the decode computed 7 steps over that KV exactly as the trusted pair did, and a decode that
reads another request's KV departs with a token drawn from the wrong distribution, not the trusted answer's
near-tied runner-up (that departure is DIFFERENT and goes to the tie-break). Clean pairs seldom flip that early
(near-ties come about once in 100 steps; the published first divergence was at token 103), so skipping those
costs a clean pair little and never resets its streak. Canary bursts through a pair on probation follow the same
rule (``IntegrityMonitor.comparison``). The logprobs compared come only from the router's own mirrors and
tie-breaks, never from a client.

The extra load is the quarantined pair's own share of the traffic, on its own decode, plus the matching prefill
work on its prefill.
"""

from __future__ import annotations

import asyncio
import logging
import math
import random
import time
from collections import Counter, deque
from dataclasses import dataclass

from tandem.registry import Role
from tandem_router.dispatch import ProxyRequest
from tandem_router.integrity.divergence import Answer, compare
from tandem_router.integrity.monitor import IntegrityMonitor, PairKey
from tandem_router.pool import Pair, WorkerPool
from tandem_router.probes.shadow import rerun
from tandem_router.transport import Transport

log = logging.getLogger("tandem.router.probation")

MAX_MIRRORS = 512  # mirrored requests in flight over all pairs on probation
KEPT_REQUESTS = 256  # recent live requests replayed to pairs on probation
MAX_KEPT_PROMPT_CHARS = 16384  # larger requests are not kept (memory stays bounded)


@dataclass(frozen=True)
class _Served:
    """A live request a trusted pair answered, and its text when it is deterministic (else mirrored for load)."""

    trusted: Pair
    req: ProxyRequest
    reference: str | None


def live_per_pair(pool: WorkerPool, monitor: IntegrityMonitor) -> int:
    """Client requests in flight per pair that serves clients (at least 1)."""
    in_flight = sum(w.in_flight for w in pool.of_role(Role.DECODE))
    out = monitor.quarantined_keys()
    serving = sum(1 for p in pool.all_pairs() if p.key not in out)
    return max(1, math.ceil(in_flight / max(1, serving)))


def load_target(pool: WorkerPool, monitor: IntegrityMonitor, pair: PairKey) -> int:
    """Concurrent requests through ``pair`` that match the pool's live load (canary burst size)."""
    probation = set(monitor.probation_pairs())
    if pair in probation:
        return mirror_targets(pool, monitor, probation)[pair]
    return live_per_pair(pool, monitor)


def mirror_targets(pool: WorkerPool, monitor: IntegrityMonitor, probation: set[PairKey]) -> dict[PairKey, int]:
    """Mirrored requests in flight wanted per pair on probation: enough that each of its workers carries what a
    serving worker of its role carries (client requests in flight / workers of that role with a serving pair),
    shared among that worker's pairs on probation. A decode's load is the sum over its pairs, and the races
    depend on the decode's load, not on one pair's."""
    in_flight = sum(w.in_flight for w in pool.of_role(Role.DECODE))
    out = monitor.quarantined_keys()
    serving = [p.key for p in pool.all_pairs() if p.key not in out]
    targets: dict[PairKey, int] = {}
    for pair in probation:
        wanted = 1
        for side, worker in enumerate(pair):
            peers = max(1, len({p[side] for p in serving}))
            sharing = sum(1 for p in probation if p[side] == worker)
            wanted = max(wanted, math.ceil(in_flight / peers / sharing))
        targets[pair] = wanted
    return targets


class ProbationMirror:
    def __init__(
        self,
        monitor: IntegrityMonitor,
        transport: Transport,
        pool: WorkerPool,
        rng: random.Random | None = None,
        timeout_s: float = 60.0,
    ) -> None:
        self.monitor, self.transport, self.pool = monitor, transport, pool
        self.rng = rng or random.Random()
        self.timeout_s = timeout_s
        self.in_flight: Counter[PairKey] = Counter()
        self._tasks: set[asyncio.Task[None]] = set()
        self._recent: deque[_Served] = deque(maxlen=KEPT_REQUESTS)
        self._cursor = 0

    def completed(self, trusted: Pair, req: ProxyRequest, outputs: list[str]) -> None:
        """A trusted pair answered ``req`` in full with ``outputs``: keep it for mirroring, top the pairs on
        probation up to their targets."""
        if not self.monitor.probation_pairs():
            self._recent.clear()
            return
        if req.parsed.items != 0 or len(outputs) != 1 or len(req.prompt) >= MAX_KEPT_PROMPT_CHARS:
            return
        self._recent.append(_Served(trusted, req, outputs[0] if req.parsed.deterministic else None))
        self._fill()

    def _fill(self) -> None:
        """Closed loop: keep each pair on probation at its target of mirrored requests in flight, replaying the
        most recent live requests (a mirror's latency on a quarantined pair differs from the live one, so one
        mirror per live request would not reach the live concurrency)."""
        probation = set(self.monitor.probation_pairs())
        if not probation or not self._recent:
            return
        targets = mirror_targets(self.pool, self.monitor, probation)
        for pair in self.pool.all_pairs():
            while self.in_flight[pair.key] < targets.get(pair.key, 0) and len(self._tasks) < MAX_MIRRORS:
                self._cursor = (self._cursor + 1) % len(self._recent)
                served = self._recent[-1 - self._cursor]
                self.in_flight[pair.key] += 1
                task = asyncio.create_task(self._mirror(pair, served))
                self._tasks.add(task)
                task.add_done_callback(self._tasks.discard)

    async def drain(self) -> None:
        await asyncio.gather(*self._tasks, return_exceptions=True)

    async def _run(self, pair: Pair, req: ProxyRequest, tag: str) -> Answer | None:
        return await rerun(self.transport, pair, req, tag, self.rng, self.timeout_s)

    async def _mirror(self, pair: Pair, served: _Served) -> None:
        try:
            answer = await self._run(pair, served.req, "mirror")
        finally:
            self.in_flight[pair.key] -= 1
        if answer is None:
            return  # no answer: reachability is the breakers' business; the next live answer refills
        self._fill()
        if served.reference is None:
            return
        near_tie = self.monitor.cfg.near_tie_nats
        trusted = Answer(served.reference)
        verdict = compare(trusted, answer, near_tie)
        if verdict.agrees:
            self.monitor.comparison(pair.key, True, numerical_at=verdict.token)
            return
        third = self._tiebreaker(served.req, {pair.key, served.trusted.key})
        tie = await self._run(third, served.req, "tiebreak") if third is not None else None
        if tie is not None and compare(tie, trusted, near_tie).agrees and not compare(tie, answer, near_tie).agrees:
            why = f"mirrored answer differs from two trusted pairs ({verdict.reason}): {answer.text[:80]!r}"
            self.monitor.comparison(pair.key, False, why)
        else:
            log.info("probation mismatch not confirmed by a third pair", extra={"request_id": served.req.request_id})
            self.monitor.inconclusive(pair.key)

    def _tiebreaker(self, req: ProxyRequest, avoid: set[PairKey]) -> Pair | None:
        pair = self.pool.choose_pair(req.prefix, time.monotonic(), frozenset(avoid))
        return None if pair is None or pair.key in avoid else pair
