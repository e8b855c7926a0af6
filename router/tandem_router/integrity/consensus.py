"""Reference answers for known-answer canaries (pure).

A canary is a deterministic request (temperature 0, fixed seed) whose prompt the router picks. Every healthy pair
returns the same answer, up to GPU numerics: without ``--enable-deterministic-inference`` a near-tied token may
flip with the batch and the rest of the answer diverge (``divergence``). Where no aggregated reference exists, the
reference is the *consensus* of the pool: the answer that the largest number of answers are SAME or NUMERICAL
with, when that is a strict majority. Pairs whose answer is DIFFERENT from it fail the canary; a NUMERICAL one
passes (counted apart). Without a strict majority nothing is decided (two equally large camps cannot be told
apart), and no pair is blamed.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field

from tandem_router.integrity.divergence import NEAR_TIE_NATS, Answer, Kind, Verdict, compare
from tandem_router.integrity.quarantine import Pair


@dataclass(frozen=True)
class CanaryVerdict:
    reference: Answer | None
    failed: frozenset[Pair]
    passed: frozenset[Pair]
    numerical: frozenset[Pair] = frozenset()  # passed, apart from the reference by numerics only
    verdicts: Mapping[Pair, Verdict] = field(default_factory=dict)  # each pair's answer against the reference


def consensus(answers: Sequence[Answer], near_tie_nats: float = NEAR_TIE_NATS) -> Answer | None:
    """The answer the most answers agree with (SAME or NUMERICAL), if they are a strict majority. Answers are
    grouped by text first (one comparison per pair of distinct texts); among equally supported texts the most
    frequent wins, then the first given."""
    groups: dict[str, list[Answer]] = {}
    for answer in answers:
        groups.setdefault(answer.text, []).append(answer)
    # A group's representative: one with logprobs when any has them (it can judge one-sided comparisons).
    reps = [next((a for a in group if a.tokens is not None), group[0]) for group in groups.values()]
    sizes = [len(group) for group in groups.values()]
    best: tuple[int, int] | None = None
    reference: Answer | None = None
    for i, rep in enumerate(reps):
        votes = sum(n for other, n in zip(reps, sizes, strict=True) if compare(rep, other, near_tie_nats).agrees)
        if best is None or (votes, sizes[i]) > best:
            best, reference = (votes, sizes[i]), rep
    if best is None or best[0] * 2 <= len(answers):
        return None
    return reference


def judge(
    answers: Mapping[Pair, Answer], reference: Answer | None = None, near_tie_nats: float = NEAR_TIE_NATS
) -> CanaryVerdict:
    """Judge each pair's answer against ``reference``, or against the consensus if none given."""
    if reference is None:
        reference = consensus(list(answers.values()), near_tie_nats)
    if reference is None:
        return CanaryVerdict(None, frozenset(), frozenset())
    verdicts = {pair: compare(reference, answer, near_tie_nats) for pair, answer in answers.items()}
    failed = frozenset(pair for pair, v in verdicts.items() if not v.agrees)
    numerical = frozenset(pair for pair, v in verdicts.items() if v.kind is Kind.NUMERICAL)
    return CanaryVerdict(reference, failed, frozenset(answers) - failed, numerical, verdicts)
