"""Sampled shadow comparison: re-run a finished deterministic request on a second pair and compare the answers.

A deterministic request (temperature 0, or an explicit seed) gives the same text on every healthy pair up to GPU
numerics: without ``--enable-deterministic-inference`` a near-tied token may flip with the batch and the rest of
the answer diverge (``integrity.divergence``). For a sampled fraction of them (``rate``), a copy of the body that
asks for the top-two logprobs goes to a second pair, with a new bootstrap room, after the client got its answer
(the client's response is untouched). An answer SAME or NUMERICAL with the client's counts as agreement
(``tandem_integrity_shadows_total{result="match"|"numerical"}``); a DIFFERENT one goes to a third pair, and the pair
whose answer is DIFFERENT from the third while the other agrees with it gets an integrity failure. No third pair,
or a third that agrees with both or neither: nobody is blamed. At most ``max_in_flight`` shadows run at once, so
the extra load stays bounded whatever the traffic.

Clients cannot make their own requests look like corruption or like numerics: the answers compared are the same
request's on different pairs, the client's one enters as the text it was sent, and the logprobs come only from the
re-runs the router makes.

The same comparison *confirms* a detector finding (``confirm``): the suspect request itself is re-run on two other
pairs, preferably ones that share no worker with the suspect pair. A client that provoked the finding with its
own prompt gets the same answer everywhere (up to numerics), so nothing is blamed; a garbling pair is in the
minority.

A pair with no other to compare with (a 1 x 1 cluster, or every other pair out) is compared with itself: a
temperature-0 request (``greedy``) is re-run through the same pair, and a DIFFERENT answer once more; the pair
fails when the second re-run sides with one of the first two answers and not the other (as between pairs), or when
the two re-runs, both the router's with their logprobs, are DIFFERENT from each other. A clean pair gives one
answer to a greedy request up to numerics (which ``compare`` tells apart exactly as between pairs, and with
logprobs on both sides checks both ways), so a pair that contradicts itself garbled one of its answers, whichever
it was; the garbling races need concurrent requests, which the pair's own traffic is. Seeded requests at a
temperature above 0 are not compared so (they may flip at any sampling threshold).

A failure pins a *pair*; the garbling races live in its decode, which the quarantine rules convict once its
failures span ``worker_spread`` prefills. When a temperature-0 request's answer failed, the router does not wait
for the decode's light traffic to garble again (one decode of many may see a garbled answer a minute): the same
request is re-run through ``CONVICT_RERUNS`` other pairs of that decode (other prefills), staggered over the time
one answer took, so that each arrives while the earlier ones decode, the concurrency the races need, and each
answer is compared with the one the two other pairs agreed on. A DIFFERENT one fails its pair (the prefills
differ: the decode is convicted); a clean decode answers them all the same up to numerics, and a culprit prefill
or transfer path is not met by them. At most once per ``CONVICT_INTERVAL_S`` a decode, within the probing budget
(``ProbeKind.CONFIRMATION``).
"""

from __future__ import annotations

import asyncio
import logging
import math
import random
import time

from tandem_router.dispatch import ProxyRequest
from tandem_router.integrity.divergence import Answer, compare
from tandem_router.integrity.monitor import IntegrityMonitor
from tandem_router.integrity.probe_budget import ProbeBudget, ProbeKind, held_s
from tandem_router.pool import Pair, WorkerPool
from tandem_router.probes.pair_request import answers_from_pair
from tandem_router.transport import Transport

log = logging.getLogger("tandem.router.shadow")

CONVICT_RERUNS = 4  # staggered re-runs of a failed request through other pairs of its decode
CONVICT_INTERVAL_S = 5.0  # at most once per decode per this


async def rerun(
    transport: Transport, pair: Pair, req: ProxyRequest, tag: str, rng: random.Random, timeout_s: float = 60.0
) -> Answer | None:
    """The answer (text and top-two logprobs) of a client request re-run through exactly ``pair`` (None if it
    could not answer, or not one)."""
    answers = await answers_from_pair(
        transport,
        pair,
        req.parsed.route.value,
        req.parsed.body,
        rng=rng,
        request_id=f"{tag}-{req.request_id}",
        timeout_s=timeout_s,
    )
    return answers[0] if answers is not None and len(answers) == 1 else None


class ShadowSampler:
    def __init__(
        self,
        monitor: IntegrityMonitor,
        transport: Transport,
        pool: WorkerPool,
        rate: float,
        max_in_flight: int = 4,
        rng: random.Random | None = None,
        max_confirming: int = 16,
        budget: ProbeBudget | None = None,
    ) -> None:
        self.monitor, self.transport, self.pool = monitor, transport, pool
        self.rate, self.max_in_flight, self.max_confirming = rate, max_in_flight, max_confirming
        self.rng = rng or random.Random()
        self.budget = budget  # for the convicting re-runs (None: not limited, for tests)
        self._tasks: set[asyncio.Task[None]] = set()
        self._confirming: set[asyncio.Task[None]] = set()
        self._convicting_at: dict[str, float] = {}  # decode -> when its convicting re-runs last started

    def confirm(self, pair: Pair, req: ProxyRequest, text: str) -> None:
        """Re-run a suspect deterministic request on two other pairs (its own budget, ``max_confirming``)."""
        if len(self._confirming) >= self.max_confirming:
            return
        task = asyncio.create_task(self._compare(pair, req, text))
        self._confirming.add(task)
        task.add_done_callback(self._confirming.discard)

    def completed(self, pair: Pair, req: ProxyRequest, outputs: list[str]) -> None:
        """Called by the proxy when a response reached the client in full."""
        if (
            self.rate <= 0
            or len(self._tasks) >= self.max_in_flight
            or req.parsed.items != 0
            or len(outputs) != 1
            or not req.parsed.deterministic
            or self.rng.random() >= self.rate
        ):
            return
        task = asyncio.create_task(self._compare(pair, req, outputs[0]))
        self._tasks.add(task)
        task.add_done_callback(self._tasks.discard)

    async def drain(self) -> None:
        await asyncio.gather(*self._tasks, *self._confirming, return_exceptions=True)

    def _other_pair(self, req: ProxyRequest, avoid: list[Pair]) -> Pair | None:
        """A pair other than ``avoid``, preferring one whose decode none of them uses."""
        keys = frozenset(p.key for p in avoid)
        decodes = {p.decode.key for p in avoid}
        sharing = frozenset(p.key for p in self.pool.all_pairs() if p.decode.key in decodes)
        now = time.monotonic()
        pair = self.pool.choose_pair(req.prefix, now, keys | sharing) or self.pool.choose_pair(req.prefix, now, keys)
        return None if pair is None or pair.key in keys else pair

    async def _compare(self, original: Pair, req: ProxyRequest, text: str) -> None:
        second = self._other_pair(req, [original])
        alone = second is None and req.parsed.greedy  # compared with itself (module docstring)
        if second is None:
            if not alone:
                return
            second = original
        started = time.monotonic()
        other = await self._run(second, req)
        took_s = time.monotonic() - started
        if other is None:
            return
        near_tie = self.monitor.cfg.near_tie_nats
        client = Answer(text)
        verdict = compare(client, other, near_tie)
        self.monitor.shadow_result(verdict.kind)
        if verdict.agrees:
            return
        third = original if alone else self._other_pair(req, [original, second])
        if third is None:
            log.info("shadow mismatch without a third pair to break the tie", extra={"request_id": req.request_id})
            return
        tie = await self._run(third, req)
        if tie is None:
            return
        with_client, with_other = compare(tie, client, near_tie).agrees, compare(tie, other, near_tie).agrees
        others = "two re-runs on the same pair" if alone else "two other pairs"
        if alone and not with_client and not with_other:
            why = f"shadow: two re-runs on the same pair differ ({other.text[:40]!r}, {tie.text[:40]!r})"
            self.monitor.failure(original.key, why)
        elif with_other and not with_client:
            self.monitor.failure(original.key, f"shadow: text differs from {others} ({text[:60]!r})")
            await self._convict(original, req, tie, took_s)
        elif with_client and not with_other:
            self.monitor.failure(second.key, f"shadow: text differs from {others} ({other.text[:60]!r})")
            await self._convict(second, req, tie, took_s)

    async def _convict(self, failed: Pair, req: ProxyRequest, reference: Answer, took_s: float) -> None:
        """Re-run ``req`` (its agreed answer: ``reference``) through other pairs of ``failed``'s decode,
        staggered over ``took_s`` (module docstring)."""
        decode, now = failed.decode.key, time.monotonic()
        if not req.parsed.greedy or now - self._convicting_at.get(decode, -math.inf) < CONVICT_INTERVAL_S:
            return
        out = self.monitor.quarantined_keys()
        partners = [p for p in self.pool.all_pairs() if p.decode.key == decode and p.key != failed.key]
        partners = [p for p in partners if p.key not in out]
        if not partners:
            return
        self._convicting_at[decode] = now
        chosen = self.rng.sample(partners, min(CONVICT_RERUNS, len(partners)))
        granted = len(chosen) if self.budget is None else self.budget.grant(ProbeKind.CONFIRMATION, len(chosen))
        chosen = chosen[:granted]
        spacing = took_s / max(1, len(chosen))
        near_tie = self.monitor.cfg.near_tie_nats

        async def one(i: int, pair: Pair) -> None:
            await asyncio.sleep(i * spacing)
            reserved, started = (0.0 if self.budget is None else self.budget.expected_s), time.monotonic()
            answer = None
            try:
                answer = await self._run(pair, req)
            finally:
                if self.budget is not None:
                    took = held_s(answer, time.monotonic() - started)
                    self.budget.settle(ProbeKind.CONFIRMATION, reserved, took)
            if answer is not None and not compare(reference, answer, near_tie).agrees:
                why = f"shadow: a re-run through the decode differs from two other pairs ({answer.text[:60]!r})"
                self.monitor.failure(pair.key, why)

        await asyncio.gather(*(one(i, pair) for i, pair in enumerate(chosen)))

    async def _run(self, pair: Pair, req: ProxyRequest) -> Answer | None:
        return await rerun(self.transport, pair, req, "shadow", self.rng)
