"""Detector findings as evidence: when text-only findings may count against a pair without a confirmation (pure).

The detectors read text a client controls in part (its prompt steers the output; a prompt pasted by one client
can show up in another's output). So one client, or one API key, must never be able to push a pair into
quarantine on detector findings alone. Each finding carries the *clients involved*: the client that sent the
request and, for a prompt leak, the clients whose prompts leaked. Findings within ``window_s`` are independent
evidence when at least ``independent`` of them have pairwise disjoint sets of clients: then no single client
took part in all of them. Anything less waits for a confirmation (a canary or shadow mismatch on the same pair)
and is promoted to failures when one comes.
"""

from __future__ import annotations

from collections import deque
from collections.abc import Iterable
from dataclasses import dataclass

Pair = tuple[str, str]


@dataclass(frozen=True)
class Finding:
    at: float
    clients: frozenset[str]
    reason: str


class DetectorEvidence:
    def __init__(self, window_s: float = 60.0, independent: int = 2, max_per_pair: int = 64) -> None:
        if independent < 2:
            raise ValueError("independent must be >= 2: one client is never enough")
        self.window_s, self.independent, self.max_per_pair = window_s, independent, max_per_pair
        self._findings: dict[Pair, deque[Finding]] = {}

    def add(self, pair: Pair, clients: Iterable[str], reason: str, now: float) -> None:
        findings = self._findings.setdefault(pair, deque(maxlen=self.max_per_pair))
        findings.append(Finding(now, frozenset(clients), reason))
        self._expire(pair, now)

    def _expire(self, pair: Pair, now: float) -> None:
        findings = self._findings.get(pair)
        while findings and findings[0].at < now - self.window_s:
            findings.popleft()
        if findings is not None and not findings:
            del self._findings[pair]

    def pending(self, pairs: Iterable[Pair], now: float) -> list[tuple[Pair, Finding]]:
        out = []
        for pair in pairs:
            self._expire(pair, now)
            out += [(pair, f) for f in self._findings.get(pair, ())]
        return out

    def independent_among(self, pairs: Iterable[Pair], now: float) -> bool:
        """Whether the findings on ``pairs`` include ``independent`` with pairwise disjoint client sets (greedy,
        oldest first: a lower bound on the true maximum, so it errs towards asking for a confirmation)."""
        chosen: list[frozenset[str]] = []
        for _, finding in self.pending(pairs, now):
            if all(finding.clients.isdisjoint(c) for c in chosen):
                chosen.append(finding.clients)
                if len(chosen) >= self.independent:
                    return True
        return False

    def discard(self, pair: Pair, finding: Finding) -> None:
        """A finding was promoted to a failure: it no longer waits."""
        findings = self._findings.get(pair)
        if findings is not None and finding in findings:
            findings.remove(finding)
            if not findings:
                del self._findings[pair]

    def forget(self, pair: Pair) -> None:
        self._findings.pop(pair, None)
