"""Race bursts: staggered known-answer probes that give a decode the concurrency the KV-offload races need
(``integrity.race_plan`` says which decode, through which prefills, and why).

A loop sweeps this router's decodes as fast as the probing budget allows (``ProbeKind.BURST``): each step sends
one burst of ``race_plan.BURST`` probes through one decode, each ``STAGGER_SHARE`` of a race probe's measured time
after the one before, and scores every answer against its prompt's reference like a canary
(``IntegrityMonitor.canary_result``): a DIFFERENT answer fails its pair. The references are learned first, as the
canary rounds learn theirs: each prompt through three pairs with distinct decodes at once (or three times through
one pair where there are fewer decodes), the answer a strict majority agrees with. The router picks the prompts
and reads its own probes' logprobs, so no client can make a burst fail a pair.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import random
import time
from collections import deque
from collections.abc import Callable, Collection

from tandem_router.integrity import race_plan
from tandem_router.integrity.consensus import consensus
from tandem_router.integrity.divergence import Answer, Kind, compare
from tandem_router.integrity.monitor import IntegrityMonitor
from tandem_router.integrity.probe_budget import ProbeBudget, ProbeKind, held_s
from tandem_router.pool import Pair
from tandem_router.probes.pair_request import known_answer
from tandem_router.transport import Transport

log = logging.getLogger("tandem.router.race")

IDLE_S = 1.0  # between steps when there is nothing to probe, or a reference could not be learned
WAIT_S = 0.05  # at least this long between steps while the budget cannot pay for a burst
PAIRS_FRESH_S = 1.0  # the pool's pairs are listed at most this often (a fleet forms P x D of them)
MAX_IN_FLIGHT = 16  # bursts at once
FIRST_GUESS_S = 0.5  # a race probe's time before one was measured
TIMES_KEPT = 32  # race probes whose times the stagger is taken from
REFERENCE_ANSWERS = 3  # answers whose strict majority is a prompt's reference
SEED = 1234


class RaceProber:
    def __init__(
        self,
        monitor: IntegrityMonitor,
        transport: Transport,
        pairs: Callable[[], list[Pair]],
        budget: ProbeBudget,
        me: str,
        members: Callable[[], Collection[str]],
        min_period_s: float = 5.0,
        timeout_s: float = 30.0,
        rng: random.Random | None = None,
    ) -> None:
        self.min_period_s = min_period_s  # between two bursts through one decode, and before the first
        self._started = time.monotonic()
        self._burst_at: dict[str, float] = {}
        self.monitor, self.transport, self.pairs, self.budget = monitor, transport, pairs, budget
        self.me, self.members, self.timeout_s = me, members, timeout_s
        self.rng = rng or random.Random()
        self.prompts = race_plan.prompts()
        self.references: dict[str, Answer] = {}
        self._last: str | None = None
        self._turns: dict[str, int] = {}
        self._tasks: set[asyncio.Task[None]] = set()
        self._listed: tuple[float, dict[str, list[Pair]]] | None = None
        self._suspected: tuple[float, set[str]] | None = None
        self._times: deque[float] = deque(maxlen=TIMES_KEPT)  # recent race probes' times

    async def run(self, stop: asyncio.Event) -> None:
        while not stop.is_set():
            try:
                wait = await self.step()
            except Exception:
                log.exception("race burst step failed")
                wait = IDLE_S
            with contextlib.suppress(TimeoutError):
                await asyncio.wait_for(stop.wait(), wait)

    async def drain(self) -> None:
        await asyncio.gather(*self._tasks, return_exceptions=True)

    def _by_decode(self) -> dict[str, list[Pair]]:
        """The pool's pairs by decode, listed at most every ``PAIRS_FRESH_S`` (a fleet forms P x D of them)."""
        now = time.monotonic()
        if self._listed is None or now - self._listed[0] >= PAIRS_FRESH_S:
            by_decode: dict[str, list[Pair]] = {}
            for pair in self.pairs():
                by_decode.setdefault(pair.decode.key, []).append(pair)
            self._listed = (now, by_decode)
        return self._listed[1]

    def _suspects(self, mine: list[str], by_decode: dict[str, list[Pair]]) -> set[str]:
        """Decodes of ``mine`` with a pair the canary rounds would probe first (under suspicion, a failed request),
        found at most every ``PAIRS_FRESH_S``."""
        now = time.monotonic()
        if self._suspected is None or now - self._suspected[0] >= PAIRS_FRESH_S:
            found = {d for d in mine if any(self.monitor.probe_first(p.key) for p in by_decode[d])}
            self._suspected = (now, found)
        return self._suspected[1]

    async def step(self) -> float:
        """Learn a missing reference, or start one burst; the seconds to wait before the next step."""
        self.budget.refresh()
        by_decode = self._by_decode()
        mine = race_plan.my_decodes(by_decode, self.members(), self.me)
        if not mine:
            return IDLE_S
        out = self.monitor.quarantined_keys()
        if len(self.references) < len(self.prompts):
            serving = {d: [p for p in ps if p.key not in out] for d, ps in by_decode.items()}
            return 0.0 if await self.learn({d: ps for d, ps in serving.items() if ps}) else IDLE_S
        now = time.monotonic()
        due = [d for d in mine if now - self._burst_at.get(d, self._started) >= self.min_period_s]
        decode = race_plan.next_decode(due, self._suspects(mine, by_decode), self._last)
        if decode is None:
            return IDLE_S
        wait = self.budget.wait_s(race_plan.BURST)
        if len(self._tasks) >= MAX_IN_FLIGHT or wait > 0:
            return min(max(wait, WAIT_S), IDLE_S)
        self._last, self._burst_at[decode] = decode, now
        by_prefill = {p.prefill.key: p for p in by_decode[decode] if p.key not in out}
        if not by_prefill:
            return 0.0  # every pair of it is out already: the next one
        if decode not in self._turns:  # sorted once a decode, not at every burst
            self._turns[decode] = race_plan.first_turn(decode, by_decode) - 1
        turn = self._turns[decode] = self._turns[decode] + 1
        chosen = [by_prefill[k] for k in race_plan.burst_prefills(list(by_prefill), turn)]
        self.budget.grant(ProbeKind.BURST, len(chosen))
        task = asyncio.create_task(self.burst(chosen))
        self._tasks.add(task)
        task.add_done_callback(self._tasks.discard)
        return 0.0

    async def learn(self, by_decode: dict[str, list[Pair]]) -> bool:
        """Each prompt without a reference (as many as the budget pays for, one after another) through
        ``REFERENCE_ANSWERS`` pairs with distinct decodes at once, or that many times in turn through one pair where
        there are fewer decodes: never two of them on one decode at once, so a racing decode cannot garble them
        alike. Their strict majority becomes the prompt's reference. Whether every reference is known now."""
        if not by_decode:
            return False
        missing = [p for p in self.prompts if p not in self.references]
        missing = missing[: self.budget.affordable() // REFERENCE_ANSWERS]  # the rest in a later step
        if not missing:
            return False
        self.budget.grant(ProbeKind.BURST, len(missing) * REFERENCE_ANSWERS)
        near_tie = self.monitor.cfg.near_tie_nats
        for prompt in missing:
            if len(by_decode) >= REFERENCE_ANSWERS:
                decodes = self.rng.sample(sorted(by_decode), REFERENCE_ANSWERS)
                pairs = [self.rng.choice(by_decode[d]) for d in decodes]
                got = list(await asyncio.gather(*(self.timed_probe(pair, prompt) for pair in pairs)))
            else:
                lone = by_decode[min(by_decode)][0]
                got = [await self.timed_probe(lone, prompt) for _ in range(REFERENCE_ANSWERS)]
            answers = [a for a in got if a is not None]
            reference = consensus(answers, near_tie) if len(answers) == REFERENCE_ANSWERS else None
            if reference is not None:
                self.references[prompt] = reference
        return len(self.references) == len(self.prompts)

    async def burst(self, pairs: list[Pair]) -> None:
        """One probe through each of ``pairs`` (one decode), ``prompts[i]`` through ``pairs[i]``, staggered; each
        answer is scored."""
        spacing = self.quickest_s() * race_plan.STAGGER_SHARE

        async def one(i: int, pair: Pair) -> Answer | None:
            await asyncio.sleep(i * spacing)
            return await self.timed_probe(pair, self.prompts[i])

        answers = await asyncio.gather(*(one(i, pair) for i, pair in enumerate(pairs)))
        near_tie = self.monitor.cfg.near_tie_nats
        for pair, prompt, answer in zip(pairs, self.prompts, answers, strict=False):
            if answer is None:
                continue
            verdict = compare(self.references[prompt], answer, near_tie)
            if verdict.kind is Kind.DIFFERENT:
                why = f"race burst answer differs ({verdict.reason}): {answer.text[:80]!r}"
                self.monitor.canary_result(pair.key, False, why)
            else:
                self.monitor.canary_result(pair.key, True, numerical_at=verdict.token)

    async def timed_probe(self, pair: Pair, prompt: str) -> Answer | None:
        """``probe``, its time settled with the budget (granted before) and, when it answered, measured."""
        reserved, started = self.budget.expected_s, time.monotonic()
        answer = None
        try:
            answer = await self.probe(pair, prompt)
            return answer
        finally:
            took = time.monotonic() - started
            self.budget.settle(ProbeKind.BURST, reserved, held_s(answer, took))
            if answer is not None:
                self._times.append(took)

    def quickest_s(self) -> float:
        """The quickest of the recent race probes: the decode's time with the least of the router's and the
        network's own delays in it (a busy router's delays would stretch the stagger past the decode's time)."""
        return min(self._times, default=FIRST_GUESS_S)

    async def probe(self, pair: Pair, prompt: str) -> Answer | None:
        return await known_answer(
            self.transport,
            pair,
            prompt,
            max_new_tokens=race_plan.TOKENS,
            seed=SEED,
            rng=self.rng,
            label="canary-race",
            timeout_s=self.timeout_s,
        )
