"""Per-pair integrity bookkeeping: scoring, quarantine, probation under load, release (pure).

A *pair* is (prefill worker, decode worker). Garbling is a property of a pair's data path (the decode's KV
pages, the transfer between the two), so the unit of quarantine is the pair; a worker is out when every pair it
is part of is. Time is passed in (``now``), never read, so every rule is table-testable.

Life of a pair: SERVING -> QUARANTINED -> PROBATION -> SERVING (released), or PROBATION -> QUARANTINED again.

- ``threshold`` integrity failures within ``window_s`` quarantine a pair. Failures are *corroborated* evidence
  (canary or shadow mismatches, detector findings confirmed by them or by independent clients; see
  ``evidence``); a detector finding of one client alone never gets here.
- A worker whose failures span ``worker_spread`` or more distinct pairs within ``window_s`` (the same decode
  garbling with two different prefills, say) is the common factor: every pair it is part of is quarantined.
- Failures backed by detector evidence alone may not quarantine more than ``max_detector_share`` of the pairs
  (at least one pair); past that share they need a canary or shadow confirmation (compare Envoy outlier
  detection's ``max_ejection_percent``).
- After ``probe_initial_s`` * 2^(quarantines so far - 1) (capped at ``probe_max_s``) a quarantined pair enters
  *probation*: it still serves no client, but live requests are mirrored to it at the pool's live concurrency
  (or canary bursts at that concurrency run through it) and its answers are compared with the trusted ones.
  ``comparisons_to_release`` clean comparisons in a row release it; one mismatch sends it back to quarantine,
  and the next probation starts after twice the wait (exponential backoff). Garbling that only shows under
  load (the offload races) cannot pass a quiet probe this way.
- A released pair is watched for ``watch_s``: one failure sends it straight back.
- A quarantine is *shared* (``QuarantineView.shared``: the other routers of the cluster adopt it, ``adopt``) when
  it rests on a comparison the router made: a canary, shadow or probation mismatch of the pair, or of a pair that
  shares a worker with it within ``window_s`` (a worker conviction anchored on one). Detector findings alone
  (text a client steers) never make a shared quarantine, and an adopted one is not shared again.
- A worker all of whose pairs were quarantined ``report_after`` times on confirmed evidence (re-quarantines after
  a failed probation included; text findings alone never count) keeps failing across cycles: it is reported as a
  repeat offender (the operator recreates its group).
"""

from __future__ import annotations

import math
from collections import deque
from collections.abc import Collection
from dataclasses import dataclass, field
from enum import StrEnum

Pair = tuple[str, str]


@dataclass(frozen=True)
class QuarantinePolicy:
    threshold: int = 2
    window_s: float = 60.0
    probe_initial_s: float = 5.0
    probe_max_s: float = 300.0
    comparisons_to_release: int = 100
    watch_s: float = 300.0
    worker_spread: int = 2
    max_detector_share: float = 0.5
    report_after: int = 3

    def __post_init__(self) -> None:
        if self.threshold < 1 or self.comparisons_to_release < 1 or self.worker_spread < 2 or self.report_after < 1:
            raise ValueError("threshold, comparisons_to_release and report_after must be >= 1, worker_spread >= 2")
        if not 0 < self.probe_initial_s <= self.probe_max_s:
            raise ValueError("need 0 < probe_initial_s <= probe_max_s")
        if not 0 < self.max_detector_share <= 1:
            raise ValueError("need 0 < max_detector_share <= 1")


class Transition(StrEnum):
    QUARANTINED = "quarantined"
    RELEASED = "released"


@dataclass
class PairRecord:
    failures: deque[float] = field(default_factory=deque)
    quarantined_at: float | None = None  # set while quarantined or on probation
    probation_since: float | None = None
    reason: str = ""
    next_probe_at: float = 0.0
    clean_comparisons: int = 0
    last_comparison_at: float = 0.0
    total_failures: int = 0
    total_quarantines: int = 0
    confirmed_quarantines: int = 0  # caused by a canary, shadow or probation mismatch (not text findings alone)
    released_at: float | None = None
    last_failure_at: float | None = None
    last_confirmed_at: float | None = None  # last failure backed by a canary or shadow comparison
    shared: bool = False  # the current quarantine rests on a comparison: other routers may adopt it


@dataclass(frozen=True)
class QuarantineView:
    prefill: str
    decode: str
    since: float
    reason: str
    next_probe_at: float
    probation: bool
    clean_comparisons: int
    quarantines: int
    shared: bool = False  # rests on a comparison this router made: the cluster's other routers adopt it


@dataclass(frozen=True)
class FailureOutcome:
    newly: tuple[Pair, ...] = ()  # pairs quarantined by this failure (the pair itself, or a worker's pairs)
    held_by_share_cap: bool = False  # detector-only evidence would have exceeded the share: confirm first


class IntegrityBook:
    def __init__(self, policy: QuarantinePolicy | None = None) -> None:
        self.policy = policy or QuarantinePolicy()
        self._pairs: dict[Pair, PairRecord] = {}

    def _record(self, pair: Pair) -> PairRecord:
        return self._pairs.setdefault(pair, PairRecord())

    def is_quarantined(self, pair: Pair) -> bool:
        """Out of client traffic: quarantined or on probation."""
        record = self._pairs.get(pair)
        return record is not None and record.quarantined_at is not None

    def in_probation(self, pair: Pair) -> bool:
        record = self._pairs.get(pair)
        return record is not None and record.probation_since is not None

    def probation_pairs(self) -> list[Pair]:
        return sorted(p for p, rec in self._pairs.items() if rec.probation_since is not None)

    def record_failure(
        self,
        pair: Pair,
        reason: str,
        now: float,
        known_pairs: list[Pair],
        *,
        detector_only: bool = False,
        corroborated: Collection[Pair] = frozenset(),
    ) -> FailureOutcome:
        """A corroborated integrity failure on ``pair``. ``detector_only``: backed by detector findings alone
        (several independent clients), so the quarantine may not exceed ``max_detector_share`` of the pairs.
        ``corroborated``: pairs another router of the cluster has quarantined. A confirmed failure (a canary or
        shadow mismatch, not detector findings) of one of them is this router's own evidence agreeing with the
        other's: it quarantines the pair at once, with the corroborated pairs that share a worker with it."""
        record = self._record(pair)
        record.total_failures += 1
        record.last_failure_at = now
        if not detector_only:
            record.last_confirmed_at = now
        if record.probation_since is not None:
            anchored = not detector_only or any(self.worker_confirmed_failing(w, now) for w in pair)
            self._quarantine(
                record, f"failed on probation: {reason}", now, confirmed=not detector_only, shared=anchored
            )
            return FailureOutcome((pair,))
        if record.quarantined_at is not None:
            return FailureOutcome()
        record.failures.append(now)
        while record.failures and record.failures[0] < now - self.policy.window_s:
            record.failures.popleft()
        watched = record.released_at is not None and now - record.released_at < self.policy.watch_s
        agreed = not detector_only and pair in corroborated
        tipped = [pair] if len(record.failures) >= self.policy.threshold or watched or agreed else []
        spread, why = self._spread(pair, known_pairs, reason, now)
        if agreed:
            known = set(known_pairs)
            siblings = [p for p in corroborated if p != pair and set(p) & set(pair) and p in known]
            spread = [*spread, *(p for p in sorted(siblings) if not self.is_quarantined(p))]
            why = why or f"quarantined by another router, and {pair} failed here too; last: {reason}"
        newly = list(dict.fromkeys([*tipped, *spread]))
        if not newly:
            return FailureOutcome()
        if detector_only and not self._within_share(newly, known_pairs):
            return FailureOutcome(held_by_share_cap=True)
        for p in newly:
            anchored = not detector_only or any(self.worker_confirmed_failing(w, now) for w in p)
            self._quarantine(
                self._record(p), reason if p in tipped else why, now, confirmed=not detector_only, shared=anchored
            )
        return FailureOutcome(tuple(newly))

    def _spread(self, pair: Pair, known_pairs: list[Pair], reason: str, now: float) -> tuple[list[Pair], str]:
        """The pairs of a worker of ``pair`` whose recent failures span ``worker_spread`` distinct pairs."""
        for worker in pair:
            failing = [
                p
                for p, rec in self._pairs.items()
                if worker in p and rec.last_failure_at is not None and rec.last_failure_at >= now - self.policy.window_s
            ]
            if len(failing) >= self.policy.worker_spread:
                spread = [p for p in known_pairs if worker in p and not self.is_quarantined(p)]
                return spread, f"{worker} failed with {len(failing)} partners; last: {reason}"
        return [], ""

    def worker_confirmed_failing(self, worker: str, now: float) -> bool:
        """Whether a pair of ``worker`` failed a canary or shadow comparison within ``window_s``."""
        return any(
            worker in p and rec.last_confirmed_at is not None and rec.last_confirmed_at >= now - self.policy.window_s
            for p, rec in self._pairs.items()
        )

    def _within_share(self, newly: list[Pair], known_pairs: list[Pair]) -> bool:
        """Whether quarantining ``newly`` keeps the quarantined share within ``max_detector_share``."""
        known = set(known_pairs) | set(newly)
        out = {p for p in known if self.is_quarantined(p)} | set(newly)
        allowed = max(1, math.floor(self.policy.max_detector_share * len(known) + 1e-9))
        return len(out) <= allowed

    def quarantined_share(self, known_pairs: list[Pair]) -> float:
        if not known_pairs:
            return 0.0
        return sum(self.is_quarantined(p) for p in known_pairs) / len(known_pairs)

    def adopt(self, pair: Pair, reason: str, now: float, known_pairs: list[Pair]) -> tuple[Pair, ...]:
        """Quarantine ``pair`` because another router of the cluster quarantined it on a comparison (a shared
        quarantine). Not shared again, and not counted towards repeat offenders (the other router reports those).
        It is a confirmed failure of its workers here too (``worker_confirmed_failing``, ``_spread``): their other
        pairs go under suspicion, and a worker whose failures (its own here, or adopted) now span ``worker_spread``
        partners is convicted: its pairs are quarantined, shared (the conviction rests on comparisons). Returns the
        pairs quarantined (none when all were out already)."""
        record = self._record(pair)
        record.last_failure_at = record.last_confirmed_at = now
        newly: list[Pair] = []
        if record.quarantined_at is None:
            self._quarantine(record, reason, now, confirmed=False, shared=False)
            newly.append(pair)
        spread, why = self._spread(pair, known_pairs, reason, now)
        for p in spread:
            self._quarantine(self._record(p), why, now, confirmed=False, shared=True)
        return (*newly, *spread)

    def _quarantine(self, record: PairRecord, reason: str, now: float, *, confirmed: bool, shared: bool) -> None:
        wait = min(self.policy.probe_initial_s * 2**record.total_quarantines, self.policy.probe_max_s)
        record.quarantined_at = now
        record.shared = shared
        record.probation_since = None
        record.reason = reason
        record.next_probe_at = now + wait
        record.clean_comparisons = 0
        record.total_quarantines += 1
        record.confirmed_quarantines += confirmed
        record.failures.clear()

    def start_probations(self, now: float) -> list[Pair]:
        """Move quarantined pairs whose wait is over into probation. Returns them."""
        started = []
        for pair, rec in sorted(self._pairs.items()):
            if rec.quarantined_at is not None and rec.probation_since is None and rec.next_probe_at <= now:
                rec.probation_since = now
                rec.last_comparison_at = now
                rec.clean_comparisons = 0
                started.append(pair)
        return started

    def record_comparison(self, pair: Pair, clean: bool, now: float, reason: str = "") -> Transition | None:
        """A pair on probation answered a mirrored request or a canary: the same as the trusted answer, or not.
        Returns RELEASED after enough clean comparisons, QUARANTINED on a mismatch."""
        record = self._pairs.get(pair)
        if record is None or record.probation_since is None:
            return None
        record.last_comparison_at = now
        if not clean:
            record.total_failures += 1
            record.last_failure_at = record.last_confirmed_at = now
            self._quarantine(record, f"failed on probation: {reason}", now, confirmed=True, shared=True)
            return Transition.QUARANTINED
        record.clean_comparisons += 1
        if record.clean_comparisons < self.policy.comparisons_to_release:
            return None
        record.quarantined_at = record.probation_since = None
        record.released_at = now
        record.reason = ""
        record.clean_comparisons = 0
        return Transition.RELEASED

    def record_inconclusive(self, pair: Pair, now: float) -> None:
        """A pair on probation answered differently, but no third pair could say who was right: the pair is not
        proven clean (its streak restarts), nor proven bad."""
        record = self._pairs.get(pair)
        if record is not None and record.probation_since is not None:
            record.clean_comparisons = 0
            record.last_comparison_at = now

    def idle_probations(self, now: float, idle_s: float) -> list[Pair]:
        """Pairs on probation without a comparison for ``idle_s`` (no mirrorable traffic): due for a canary
        burst. Taking them resets their idle clock, so each is handed out once per ``idle_s``."""
        due = [
            p
            for p, rec in self._pairs.items()
            if rec.probation_since is not None and rec.last_comparison_at <= now - idle_s
        ]
        for pair in due:
            self._pairs[pair].last_comparison_at = now
        return sorted(due)

    def forget(self, pair: Pair) -> None:
        """Drop a pair whose worker left the pool or was recreated (a new incarnation starts clean)."""
        self._pairs.pop(pair, None)

    def quarantined(self) -> list[QuarantineView]:
        return [
            QuarantineView(
                p,
                d,
                rec.quarantined_at,
                rec.reason,
                rec.next_probe_at,
                rec.probation_since is not None,
                rec.clean_comparisons,
                rec.total_quarantines,
                rec.shared,
            )
            for (p, d), rec in sorted(self._pairs.items())
            if rec.quarantined_at is not None
        ]

    def quarantined_workers(self, pairs: list[Pair]) -> set[str]:
        """Workers all of whose current pairs are quarantined (they get no traffic at all)."""
        bad: dict[str, bool] = {}
        for pair in pairs:
            q = self.is_quarantined(pair)
            for worker in pair:
                bad[worker] = bad.get(worker, True) and q
        return {worker for worker, all_bad in bad.items() if all_bad}

    def repeat_offenders(self, pairs: list[Pair]) -> dict[str, tuple[int, str]]:
        """Workers all of whose pairs were quarantined ``report_after``+ times on confirmed evidence (canary,
        shadow or probation mismatches: text findings alone, which clients can provoke, do not count):
        worker -> (quarantines, last reason)."""
        out: dict[str, tuple[int, str]] = {}
        for pair in pairs:
            rec = self._pairs.get(pair)
            if rec is None or rec.confirmed_quarantines < self.policy.report_after:
                continue
            for worker in pair:
                if all(self._quarantines(p) >= self.policy.report_after for p in pairs if worker in p):
                    count = max(out.get(worker, (0, ""))[0], rec.confirmed_quarantines)
                    out[worker] = (count, rec.reason or out.get(worker, (0, ""))[1])
        return out

    def _quarantines(self, pair: Pair) -> int:
        rec = self._pairs.get(pair)
        return 0 if rec is None else rec.confirmed_quarantines

    def totals(self, pair: Pair) -> tuple[int, int]:
        """(integrity failures, quarantines) ever recorded for the pair."""
        record = self._pairs.get(pair)
        return (0, 0) if record is None else (record.total_failures, record.total_quarantines)
