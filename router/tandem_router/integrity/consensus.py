"""Reference answers for known-answer canaries (pure).

A canary is a deterministic request (temperature 0, fixed seed): every healthy pair must return the same text.
Where no aggregated reference exists, the reference is the *consensus* of the pool: the answer a strict
majority of pairs gave. Pairs that disagree with the consensus fail the canary. Without a strict majority
nothing is decided (two equally large camps cannot be told apart), and no pair is blamed.
"""

from __future__ import annotations

from collections import Counter
from collections.abc import Mapping
from dataclasses import dataclass

from tandem_router.integrity.quarantine import Pair


@dataclass(frozen=True)
class CanaryVerdict:
    reference: str | None
    failed: frozenset[Pair]
    passed: frozenset[Pair]


def judge(answers: Mapping[Pair, str], reference: str | None = None) -> CanaryVerdict:
    """Judge each pair's answer against ``reference``, or against the strict-majority answer if none given."""
    if reference is None:
        counts = Counter(answers.values())
        if counts:
            answer, votes = counts.most_common(1)[0]
            if votes * 2 > len(answers):
                reference = answer
    if reference is None:
        return CanaryVerdict(None, frozenset(), frozenset())
    failed = frozenset(pair for pair, text in answers.items() if text != reference)
    return CanaryVerdict(reference, failed, frozenset(answers) - failed)
