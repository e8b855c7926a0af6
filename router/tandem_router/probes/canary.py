"""Known-answer canaries: deterministic probes through specific (prefill, decode) pairs.

Every ``interval_s`` (rounds start at multiples of it on the wall clock, so the routers of a cluster tick together)
one canary prompt (temperature 0, fixed seed) goes through this router's share of the round's plan
(``integrity.probe_plan``): pairs to probe first (under suspicion, a failed request, a worker seen for the first
time), then a rotation that gives every worker ``sample`` partners a round (a window of it while race bursts
sweep the decodes, ``probe_plan``). The routers split the plan by a
rendezvous hash over the routers registered in the registry (``members``), and the probing budget
(``integrity.probe_budget``) cuts what does not fit. Each answer carries the top-two logprobs of every token. The
reference answer is the answer a strict majority of the round's answers is SAME or NUMERICAL with
(``integrity.consensus``), or the last round's reference when fewer than three pairs answered: without
``--enable-deterministic-inference`` a near-tied token may flip with the batch on a clean pair, and that is counted
(``tandem_integrity_canaries_total{result="numerical"}``), never a failure. Pairs whose answer is DIFFERENT from
the reference fail the canary. The router picks the prompts and asks for the logprobs, so no client can make a
canary look like corruption or like numerics. Canary rounds never release a quarantined pair.

Bursts: every canary whose reference is known, cycled up to ``size`` concurrent requests through one pair (as many
as the budget grants). They confirm a detector finding that a shadow re-run cannot (the suspect request was not
deterministic), and they give a pair on probation comparisons at the pool's live concurrency when no mirrorable
live traffic does (``probation.py`` mirrors live requests otherwise). A pair that cannot be reached is the
breakers' business, not an integrity failure: it is skipped.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import random
import time
from collections.abc import Callable, Collection, Mapping
from dataclasses import dataclass

from tandem_router.integrity.consensus import consensus, judge
from tandem_router.integrity.divergence import Answer, Kind, compare
from tandem_router.integrity.monitor import IntegrityMonitor, PairKey
from tandem_router.integrity.probe_budget import ProbeBudget, ProbeKind, held_s
from tandem_router.integrity.probe_plan import (
    DEFAULT_SAMPLE,
    ROTATION_BESIDE_BURSTS,
    plan_round,
    round_number,
    rounds_to_cover,
)
from tandem_router.pool import Pair
from tandem_router.probes.pair_request import known_answer
from tandem_router.probes.race import RaceProber
from tandem_router.transport import Transport

log = logging.getLogger("tandem.router.canary")

MAX_BURST = 64  # concurrent canaries through one pair
PEER_CONFIRM_S = 5.0  # a pair another router quarantined is confirmed here at most this often
SELF_CONSISTENCY = 3  # answers of a lone pair whose majority is its known answer (``known_answer``)

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
    sample: int = DEFAULT_SAMPLE  # partners each worker is probed with per round (``probe_plan.rotation``)


@dataclass(frozen=True)
class ProbeScope:
    """Who probes what: this router's id, the ids of the cluster's routers (this one included or not), the pairs to
    probe before the rotation, and the pairs other routers quarantined: a mapping gives each pair the peers' shared
    entries (``members``: adopted here at once); pairs without one are confirmed here with bursts."""

    me: str
    members: Callable[[], Collection[str]]
    probe_first: Callable[[PairKey], bool]
    peer_quarantined: Callable[[], Mapping[PairKey, Collection[str]] | Collection[PairKey]] = frozenset


class CanaryProber:
    def __init__(
        self,
        monitor: IntegrityMonitor,
        transport: Transport,
        pairs: Callable[[], list[Pair]],
        budget: ProbeBudget,
        scope: ProbeScope,
        cfg: CanaryConfig | None = None,
        rng: random.Random | None = None,
        concurrency: Callable[[PairKey], int] = lambda pair: 1,
        wall_clock: Callable[[], float] = time.time,
        race: RaceProber | None = None,
    ) -> None:
        self.race = race  # its sweep runs alongside the rounds (``run``)
        self.monitor = monitor
        self.transport = transport
        self.pairs = pairs
        self.budget = budget
        self.scope = scope
        self.concurrency = concurrency  # concurrent requests through a pair at the pool's live load
        self.cfg = cfg or CanaryConfig()
        self.wall_clock = wall_clock
        self._tasks: set[asyncio.Task[None]] = set()
        self.rng = rng or random.Random()
        self.references: dict[str, Answer] = {}
        self._round = 0
        self._workers_seen: set[tuple[str, int]] | None = None  # (key, epoch) of every worker at the last round
        self._peer_confirmed: dict[PairKey, float] = {}  # pair -> when a peer's quarantine was last confirmed here

    async def run(self, stop: asyncio.Event) -> None:
        """A round at start, then at each multiple of ``interval_s`` of the wall clock; in between (every 0.5 s)
        quarantined pairs whose wait is over go on probation, and pairs on probation without comparisons for
        ``probation_idle_s`` get a canary burst. The race bursts' sweep runs alongside, until ``stop``."""
        if self.race is not None:
            task = asyncio.create_task(self.race.run(stop))
            self._tasks.add(task)
            task.add_done_callback(self._tasks.discard)
        next_round = 0.0
        loop = asyncio.get_running_loop()
        while not stop.is_set():
            try:
                if loop.time() >= next_round:
                    await self.round()
                    wall = self.wall_clock()
                    next_round = (
                        loop.time() + (round_number(wall, self.cfg.interval_s) + 1) * self.cfg.interval_s - wall
                    )
                self.monitor.start_probations()
                self.confirm_peer_quarantines()
                await self.probation_bursts()
            except Exception:
                log.exception("canary iteration failed")
            with contextlib.suppress(TimeoutError):
                await asyncio.wait_for(stop.wait(), 0.5)

    def _first(self, pairs: list[Pair]) -> list[PairKey]:
        """Pairs to probe before the rotation: the monitor's (suspicion, failed requests), and every pair of a worker
        that was not there (or had another epoch) at the last round."""
        workers = {(spec.key, spec.epoch) for pair in pairs for spec in (pair.prefill, pair.decode)}
        new = set() if self._workers_seen is None else {key for key, _ in workers - self._workers_seen}
        self._workers_seen = workers
        return [p.key for p in pairs if new & set(p.key) or self.scope.probe_first(p.key)]

    async def round(self) -> None:
        """One prompt through this router's share of the round's plan, as far as the budget goes; judge by
        consensus; score every pair that answered."""
        prompt = CANARY_PROMPTS[self._round % len(CANARY_PROMPTS)]
        self._round += 1
        pairs = {p.key: p for p in self.pairs()}
        first = self._first(list(pairs.values()))
        round_no = round_number(self.wall_clock(), self.cfg.interval_s)
        beside_bursts = None if self.race is None else ROTATION_BESIDE_BURSTS
        members = self.scope.members()
        plan = plan_round(pairs, round_no, self.cfg.sample, first, members, self.scope.me, beside_bursts)
        if len(plan) == 1 and prompt not in self.references:
            await self.known_answer(pairs[plan[0]], prompt)
            return
        plan = plan[: self.budget.grant(ProbeKind.CANARY, len(plan))]
        if not plan or (len(plan) < 2 and prompt not in self.references):
            return  # one answer is no consensus; nothing to compare against
        answers = await asyncio.gather(*(self.timed_probe(ProbeKind.CANARY, pairs[key], prompt) for key in plan))
        by_pair: dict[PairKey, Answer] = {key: a for key, a in zip(plan, answers, strict=True) if a is not None}
        near_tie = self.monitor.cfg.near_tie_nats
        verdict = judge(by_pair, self.references.get(prompt) if len(by_pair) < 3 else None, near_tie)
        if verdict.reference is None or (len(by_pair) < 2 and prompt not in self.references):
            log.warning("canary round without a majority answer", extra={"pairs": len(plan), "answered": len(by_pair)})
            return
        self.references[prompt] = verdict.reference
        log.info(
            "canary round",
            extra={
                "round": round_no,
                "pairs": len(pairs),
                "probed": len(plan),
                "first": len(first),
                "rounds_to_cover": rounds_to_cover(
                    len({p for p, _ in pairs}), len({d for _, d in pairs}), self.cfg.sample
                ),
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

    async def known_answer(self, pair: Pair, prompt: str) -> None:
        """A prompt without a reference through a lone pair (a 1 x 1 cluster, or this router's share of a round):
        ``SELF_CONSISTENCY`` answers of the pair itself, and their consensus becomes the reference (the pair's own
        known answer, judged against in later rounds). A clean pair answers a canary the same each time up to
        numerics (``consensus`` groups NUMERICAL answers as it groups pairs); an answer DIFFERENT from the
        majority of the pair's own fails it. No majority: nothing decided, no reference. Sent only when the budget
        grants all of them."""
        if self.budget.affordable() < SELF_CONSISTENCY:
            self.budget.metrics.denied.labels(ProbeKind.CANARY.value).inc(SELF_CONSISTENCY)
            return
        granted = self.budget.grant(ProbeKind.CANARY, SELF_CONSISTENCY)
        got = await asyncio.gather(*(self.timed_probe(ProbeKind.CANARY, pair, prompt) for _ in range(granted)))
        answers = [a for a in got if a is not None]
        near_tie = self.monitor.cfg.near_tie_nats
        reference = consensus(answers, near_tie) if len(answers) == SELF_CONSISTENCY else None
        if reference is None:
            log.warning("lone-pair canary without a majority answer", extra={"answered": len(answers)})
            return
        self.references[prompt] = reference
        if pair.key in self.monitor.quarantined_keys():
            return
        verdicts = [compare(reference, a, near_tie) for a in answers]
        bad = next((v for v in verdicts if not v.agrees), None)
        if bad is None:
            numerical = next((v.token for v in verdicts if v.kind is Kind.NUMERICAL), None)
            self.monitor.canary_result(pair.key, True, numerical_at=numerical)
        else:
            self.monitor.canary_result(pair.key, False, f"canary answers of the pair disagree ({bad.reason})")

    async def probation_bursts(self) -> None:
        """A burst at the pool's live concurrency through each pair on probation that mirroring left idle."""
        due = set(self.monitor.idle_probations(self.cfg.probation_idle_s))
        if not due:
            return  # listing the pool's pairs twice a second costs a fleet's router real CPU (P x D of them)
        pairs = [p for p in self.pairs() if p.key in due]
        await asyncio.gather(*(self.burst(pair, self.concurrency(pair.key), ProbeKind.BURST) for pair in pairs))

    def confirm_peer_quarantines(self) -> None:
        """Quarantines other routers share (they rest on their comparisons) are adopted at once. Each other pair
        another router quarantined that this one still serves goes under suspicion here (its
        deterministic answers are compared: the races need live prompts that fill KV pages, which canaries do not)
        and gets a canary burst (a broken data path), at most once per ``PEER_CONFIRM_S`` a pair
        (``members``: detector findings alone are judged by each router on what it saw itself)."""
        now = time.monotonic()
        reported = self.scope.peer_quarantined()
        if isinstance(reported, Mapping):
            self.monitor.adopt(reported)
        quarantined, peers = self.monitor.quarantined_keys(), set(reported)
        self._peer_confirmed = {k: at for k, at in self._peer_confirmed.items() if k in peers}
        due = [k for k in peers - quarantined if now - self._peer_confirmed.get(k, -PEER_CONFIRM_S) >= PEER_CONFIRM_S]
        if not due:
            return
        serving = {p.key: p for p in self.pairs()}  # once: a fleet forms P x D pairs
        for key in due:
            self._peer_confirmed[key] = now
            self.monitor.suspect(key)
            if key in serving:
                self._burst_soon(serving[key])

    def confirm_soon(self, key: PairKey) -> None:
        """Confirm a detector finding on ``key`` with a canary burst, in the background."""
        pair = next((p for p in self.pairs() if p.key == key), None)
        if pair is not None:
            self._burst_soon(pair)

    def _burst_soon(self, pair: Pair) -> None:
        if not self.references:
            return
        task = asyncio.create_task(self.burst(pair, self.concurrency(pair.key), ProbeKind.CONFIRMATION))
        self._tasks.add(task)
        task.add_done_callback(self._tasks.discard)

    async def drain(self) -> None:
        await asyncio.gather(*self._tasks, return_exceptions=True)
        if self.race is not None:
            await self.race.drain()

    async def burst(self, pair: Pair, size: int, kind: ProbeKind) -> None:
        """``size`` concurrent canaries (known references, cycled; as many as the budget grants) through ``pair``;
        each answer is scored."""
        known = list(self.references)
        if not known:
            return
        wanted = max(len(known), min(size, MAX_BURST))
        prompts = [known[i % len(known)] for i in range(self.budget.grant(kind, wanted))]
        answers = await asyncio.gather(*(self.timed_probe(kind, pair, prompt) for prompt in prompts))
        for prompt, answer in zip(prompts, answers, strict=True):
            if answer is None:
                continue
            verdict = compare(self.references[prompt], answer, self.monitor.cfg.near_tie_nats)
            if verdict.kind is Kind.DIFFERENT:
                why = f"canary burst answer differs ({verdict.reason}): {answer.text[:80]!r}"
                self.monitor.canary_result(pair.key, False, why)
            else:
                self.monitor.canary_result(pair.key, True, numerical_at=verdict.token)

    async def timed_probe(self, kind: ProbeKind, pair: Pair, prompt: str) -> Answer | None:
        """``probe``, its time settled with the budget (the probe was granted before)."""
        reserved, started = self.budget.expected_s, time.monotonic()
        answer = None
        try:
            answer = await self.probe(pair, prompt)
            return answer
        finally:
            self.budget.settle(kind, reserved, held_s(answer, time.monotonic() - started))

    async def probe(self, pair: Pair, prompt: str) -> Answer | None:
        """The decode's answer (text and logprobs) for ``prompt`` through exactly this pair, or None if the pair
        could not answer."""
        return await known_answer(
            self.transport,
            pair,
            prompt,
            max_new_tokens=self.cfg.max_new_tokens,
            seed=self.cfg.seed,
            rng=self.rng,
            label="canary",
            timeout_s=self.cfg.timeout_s,
        )
