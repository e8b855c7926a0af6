"""Per-pair integrity bookkeeping: scoring, quarantine, re-probing with backoff, re-admission (pure).

A *pair* is (prefill worker, decode worker). Garbling is a property of a pair's data path (the decode's KV
pages, the transfer between the two), so the unit of quarantine is the pair; a worker is quarantined when every
pair it is part of is. Time is passed in (``now``), never read, so every rule is table-testable.

Rules:
- ``threshold`` integrity failures (detector hits, failed canaries) within ``window_s`` quarantine a pair.
- A quarantined pair is re-probed (known-answer canary) after ``probe_initial_s``, doubling up to
  ``probe_max_s`` after each failed probe; ``clean_probes_to_release`` consecutive clean probes release it.
- A worker whose integrity failures span ``worker_spread`` or more distinct pairs within ``window_s`` (the same
  decode garbling with two different prefills, say) is the common factor: every pair it is part of is
  quarantined at once, without waiting for each pair to reach ``threshold`` on its own.
- A released pair is on probation for ``probation_s``: one failure sends it back, and each repeated quarantine
  starts from a doubled probe interval. Garbling that only shows under load (the offload races) can pass a quiet
  probe; probation keeps such a pair from flapping back into traffic at full rate.
"""

from __future__ import annotations

from collections import deque
from dataclasses import dataclass, field
from enum import StrEnum

Pair = tuple[str, str]


@dataclass(frozen=True)
class QuarantinePolicy:
    threshold: int = 2
    window_s: float = 60.0
    probe_initial_s: float = 5.0
    probe_max_s: float = 300.0
    clean_probes_to_release: int = 2
    probation_s: float = 300.0
    worker_spread: int = 2

    def __post_init__(self) -> None:
        if self.threshold < 1 or self.clean_probes_to_release < 1 or self.worker_spread < 2:
            raise ValueError("threshold and clean_probes_to_release must be >= 1, worker_spread >= 2")
        if not 0 < self.probe_initial_s <= self.probe_max_s:
            raise ValueError("need 0 < probe_initial_s <= probe_max_s")


class Transition(StrEnum):
    QUARANTINED = "quarantined"
    RELEASED = "released"


@dataclass
class PairRecord:
    failures: deque[float] = field(default_factory=deque)
    quarantined_at: float | None = None
    reason: str = ""
    next_probe_at: float = 0.0
    probe_interval: float = 0.0
    clean_probes: int = 0
    total_failures: int = 0
    total_quarantines: int = 0
    released_at: float | None = None
    last_failure_at: float | None = None


@dataclass(frozen=True)
class QuarantineView:
    prefill: str
    decode: str
    since: float
    reason: str
    next_probe_at: float
    clean_probes: int


class IntegrityBook:
    def __init__(self, policy: QuarantinePolicy | None = None) -> None:
        self.policy = policy or QuarantinePolicy()
        self._pairs: dict[Pair, PairRecord] = {}

    def _record(self, pair: Pair) -> PairRecord:
        return self._pairs.setdefault(pair, PairRecord())

    def is_quarantined(self, pair: Pair) -> bool:
        record = self._pairs.get(pair)
        return record is not None and record.quarantined_at is not None

    def record_failure(self, pair: Pair, reason: str, now: float) -> Transition | None:
        """An integrity failure seen on live traffic or a canary. Returns QUARANTINED when it tips the pair."""
        record = self._record(pair)
        record.total_failures += 1
        record.last_failure_at = now
        if record.quarantined_at is not None:
            return None
        record.failures.append(now)
        while record.failures and record.failures[0] < now - self.policy.window_s:
            record.failures.popleft()
        on_probation = record.released_at is not None and now - record.released_at < self.policy.probation_s
        if len(record.failures) < self.policy.threshold and not on_probation:
            return None
        self._quarantine(record, reason, now)
        return Transition.QUARANTINED

    def spread_to_workers(self, pair: Pair, known_pairs: list[Pair], reason: str, now: float) -> list[Pair]:
        """After a failure on ``pair``: quarantine every known pair of a worker of ``pair`` whose recent failures
        span ``worker_spread`` distinct pairs. Returns the pairs newly quarantined."""
        newly: list[Pair] = []
        for worker in pair:
            failing = [
                p
                for p, rec in self._pairs.items()
                if worker in p and rec.last_failure_at is not None and rec.last_failure_at >= now - self.policy.window_s
            ]
            if len(failing) < self.policy.worker_spread:
                continue
            why = f"{worker} failed with {len(failing)} partners; last: {reason}"
            for p in known_pairs:
                if worker in p and not self.is_quarantined(p):
                    self._quarantine(self._record(p), why, now)
                    newly.append(p)
        return newly

    def _quarantine(self, record: PairRecord, reason: str, now: float) -> None:
        record.quarantined_at = now
        record.reason = reason
        record.probe_interval = min(self.policy.probe_initial_s * 2**record.total_quarantines, self.policy.probe_max_s)
        record.next_probe_at = now + record.probe_interval
        record.clean_probes = 0
        record.total_quarantines += 1
        record.failures.clear()

    def probes_due(self, now: float) -> list[Pair]:
        return [
            pair for pair, rec in self._pairs.items() if rec.quarantined_at is not None and rec.next_probe_at <= now
        ]

    def record_probe(self, pair: Pair, clean: bool, now: float, reason: str = "") -> Transition | None:
        """Result of a re-probe of a quarantined pair. Returns RELEASED when the pair is admitted again."""
        record = self._pairs.get(pair)
        if record is None or record.quarantined_at is None:
            return None
        if not clean:
            record.clean_probes = 0
            record.probe_interval = min(record.probe_interval * 2, self.policy.probe_max_s)
            record.next_probe_at = now + record.probe_interval
            record.reason = reason or record.reason
            return None
        record.clean_probes += 1
        if record.clean_probes < self.policy.clean_probes_to_release:
            record.next_probe_at = now  # confirm right away: a released pair should not wait a full interval
            return None
        record.quarantined_at = None
        record.released_at = now
        record.reason = ""
        record.clean_probes = 0
        return Transition.RELEASED

    def forget(self, pair: Pair) -> None:
        """Drop a pair whose worker left the pool (a recreated worker starts clean)."""
        self._pairs.pop(pair, None)

    def quarantined(self) -> list[QuarantineView]:
        return [
            QuarantineView(p, d, rec.quarantined_at, rec.reason, rec.next_probe_at, rec.clean_probes)
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

    def totals(self, pair: Pair) -> tuple[int, int]:
        """(integrity failures, quarantines) ever recorded for the pair."""
        record = self._pairs.get(pair)
        return (0, 0) if record is None else (record.total_failures, record.total_quarantines)
