"""Known-answer canaries: deterministic probes through each specific (prefill, decode) pair.

Every ``interval_s`` one canary prompt (temperature 0, fixed seed) goes through every pair the pool can form,
quarantined ones included, with the top-two logprobs of every token. The reference answer is the answer a strict
majority of the pool's answers is SAME or NUMERICAL with (``integrity.consensus``): without
``--enable-deterministic-inference`` a near-tied token may flip with the batch on a clean pair, and that is counted
(``tandem_integrity_canaries_total{result="numerical"}``), never a failure. Pairs whose answer is DIFFERENT from
the reference fail the canary. The router picks the prompts and asks for the logprobs, so no client can make a
canary look like corruption or like numerics. Canary rounds never release a quarantined pair.

Bursts: every canary whose reference is known, cycled up to ``size`` concurrent requests through one pair.
They confirm a detector finding that a shadow re-run cannot (the suspect request was not deterministic), and
they give a pair on probation comparisons at the pool's live concurrency when no mirrorable live traffic does
(``probation.py`` mirrors live requests otherwise). A pair that cannot be reached is the breakers' business, not
an integrity failure: it is skipped.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import random
from collections.abc import Callable
from dataclasses import dataclass

from tandem_router.integrity.consensus import judge
from tandem_router.integrity.divergence import Answer, Kind, compare
from tandem_router.integrity.monitor import IntegrityMonitor, PairKey
from tandem_router.pair_request import answers_from_pair
from tandem_router.pool import Pair
from tandem_router.transport import Transport

log = logging.getLogger("tandem.router.canary")

MAX_BURST = 64  # concurrent canaries through one pair

CANARY_PROMPTS: tuple[str, ...] = (
    "Canary: list the planets of the solar system in order from the sun.",
    "Canary: explain in one paragraph why the sky appears blue during the day.",
    "Canary: write three short sentences about a lighthouse keeper and the sea.",
    "Canary: describe how a bicycle converts pedalling into forward motion.",
)


@dataclass(frozen=True)
class CanaryConfig:
    interval_s: float = 30.0
    max_new_tokens: int = 32
    timeout_s: float = 30.0
    seed: int = 1234
    probation_idle_s: float = 5.0  # a pair on probation without comparisons this long gets a canary burst


class CanaryProber:
    def __init__(
        self,
        monitor: IntegrityMonitor,
        transport: Transport,
        pairs: Callable[[], list[Pair]],
        cfg: CanaryConfig | None = None,
        rng: random.Random | None = None,
        concurrency: Callable[[PairKey], int] = lambda pair: 1,
    ) -> None:
        self.monitor = monitor
        self.transport = transport
        self.pairs = pairs
        self.concurrency = concurrency  # concurrent requests through a pair at the pool's live load
        self.cfg = cfg or CanaryConfig()
        self._tasks: set[asyncio.Task[None]] = set()
        self.rng = rng or random.Random()
        self.references: dict[str, Answer] = {}
        self._round = 0

    async def run(self, stop: asyncio.Event) -> None:
        """Rounds every ``interval_s``; in between (every 0.5 s) quarantined pairs whose wait is over go on
        probation, and pairs on probation without comparisons for ``probation_idle_s`` get a canary burst."""
        next_round = 0.0
        loop = asyncio.get_running_loop()
        while not stop.is_set():
            try:
                if loop.time() >= next_round:
                    await self.round()
                    next_round = loop.time() + self.cfg.interval_s
                self.monitor.start_probations()
                await self.probation_bursts()
            except Exception:
                log.exception("canary iteration failed")
            with contextlib.suppress(TimeoutError):
                await asyncio.wait_for(stop.wait(), 0.5)

    async def round(self) -> None:
        """One prompt through every pair; judge by consensus; score every pair that answered."""
        prompt = CANARY_PROMPTS[self._round % len(CANARY_PROMPTS)]
        self._round += 1
        pairs = self.pairs()
        if len(pairs) < 2:
            return  # one answer is no consensus; nothing to compare against
        answers = await asyncio.gather(*(self.probe(pair, prompt) for pair in pairs))
        by_pair: dict[PairKey, Answer] = {p.key: a for p, a in zip(pairs, answers, strict=True) if a is not None}
        near_tie = self.monitor.cfg.near_tie_nats
        verdict = judge(by_pair, self.references.get(prompt) if len(by_pair) < 3 else None, near_tie)
        if verdict.reference is None:
            log.warning("canary round without a majority answer", extra={"pairs": len(pairs), "answered": len(by_pair)})
            return
        self.references[prompt] = verdict.reference
        log.info(
            "canary round",
            extra={
                "pairs": len(pairs),
                "answered": len(by_pair),
                "failed": sorted(verdict.failed),
                "numerical": len(verdict.numerical),
            },
        )
        # Quarantined pairs' answers count towards the consensus but not for their release: that is the job of
        # the scheduled burst re-probes (one quiet clean answer proves little against a load-dependent race).
        for key in verdict.passed - self.monitor.quarantined_keys():
            self.monitor.canary_result(key, True, numerical_at=verdict.verdicts[key].token)
        for key in verdict.failed - self.monitor.quarantined_keys():
            why = f"canary answer differs from the pool's ({verdict.verdicts[key].reason}): {by_pair[key].text[:80]!r}"
            self.monitor.canary_result(key, False, why)

    async def probation_bursts(self) -> None:
        """A burst at the pool's live concurrency through each pair on probation that mirroring left idle."""
        due = set(self.monitor.idle_probations(self.cfg.probation_idle_s))
        pairs = [p for p in self.pairs() if p.key in due]
        await asyncio.gather(*(self.burst(pair, self.concurrency(pair.key)) for pair in pairs))

    def confirm_soon(self, key: PairKey) -> None:
        """Confirm a detector finding on ``key`` with a canary burst, in the background."""
        pair = next((p for p in self.pairs() if p.key == key), None)
        if pair is None or not self.references:
            return
        task = asyncio.create_task(self.burst(pair, self.concurrency(pair.key)))
        self._tasks.add(task)
        task.add_done_callback(self._tasks.discard)

    async def drain(self) -> None:
        await asyncio.gather(*self._tasks, return_exceptions=True)

    async def burst(self, pair: Pair, size: int) -> None:
        """``size`` concurrent canaries (known references, cycled) through ``pair``; each answer is scored."""
        known = list(self.references)
        if not known:
            return
        prompts = [known[i % len(known)] for i in range(max(len(known), min(size, MAX_BURST)))]
        answers = await asyncio.gather(*(self.probe(pair, prompt) for prompt in prompts))
        for prompt, answer in zip(prompts, answers, strict=True):
            if answer is None:
                continue
            verdict = compare(self.references[prompt], answer, self.monitor.cfg.near_tie_nats)
            if verdict.kind is Kind.DIFFERENT:
                why = f"canary burst answer differs ({verdict.reason}): {answer.text[:80]!r}"
                self.monitor.canary_result(pair.key, False, why)
            else:
                self.monitor.canary_result(pair.key, True, numerical_at=verdict.token)

    async def probe(self, pair: Pair, prompt: str) -> Answer | None:
        """The decode's answer (text and logprobs) for ``prompt`` through exactly this pair, or None if the pair
        could not answer."""
        params = {
            "temperature": 0.0,
            "max_new_tokens": self.cfg.max_new_tokens,
            "sampling_seed": self.cfg.seed,  # SGLang 0.5.23 SamplingParams
        }
        answers = await answers_from_pair(
            self.transport,
            pair,
            "/generate",
            {"text": prompt, "sampling_params": params},
            rng=self.rng,
            request_id=f"canary-{self.rng.getrandbits(48):x}",
            timeout_s=self.cfg.timeout_s,
        )
        return answers[0] if answers is not None and len(answers) == 1 else None
