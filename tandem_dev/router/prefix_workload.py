"""The multi-turn chat workloads of ``tandem bench prefix``: the one the router's defaults were tuned on, and
held-out ones they were not.

Why held-out shapes (issue #41 item 6): ``--balance-abs-threshold``'s default (4096 tokens) was chosen by running
``tandem bench prefix`` on ``TUNING`` with seed ``SEED``; a comparison with ``smg`` on that same workload measures
the tuning as much as the policy. ``HELD_OUT`` differ in what the threshold trades off (how many conversations
share a prefix, how many prefills a prefix group spans, how big and how bursty the prompts are) and run on
``HELD_OUT_SEEDS``, none of which was used for tuning. None of them may be used to tune a default either: a
default tuned on them makes them tuning workloads, to be replaced by new held-out ones.

A workload: users, each under one of ``system_prompts`` shared system prompts, hold conversations of ``turns``
turns; every turn resends the whole history (system prompt, earlier questions and answers) plus a new question,
streams the answer, and the user thinks a while before the next turn. Every ``document_every``-th user pastes a
long document into its first question (prompts of very different sizes, as in document chat). Users start spread
over the first ``start_spread_s`` seconds.
"""

from __future__ import annotations

import random
from dataclasses import dataclass


@dataclass(frozen=True)
class Shape:
    name: str
    users: int  # full run; ``--quick`` runs fewer (tandem_dev.router.bench_prefix)
    turns: int
    system_prompts: int
    system_words: int
    question_words: int
    answer_words: int
    document_words: int
    document_every: int  # every n-th user (0, n, 2n, ...) pastes a document into its first question; 0: nobody
    think_s: tuple[float, float]  # pause after each answer, uniform in this range
    start_spread_s: float = 3.0

    def describe(self) -> str:
        docs = (
            f"1 user in {self.document_every} pastes a {self.document_words}-word document into the first question"
            if self.document_every
            else "no documents"
        )
        return (
            f"{self.system_prompts} x {self.system_words}-word system prompts, {self.question_words}-word "
            f"questions, {self.answer_words}-word answers, {docs}, {self.think_s[0]:g}-{self.think_s[1]:g} s pauses, "
            f"starts over {self.start_spread_s:g} s"
        )


# The workload --balance-abs-threshold's default was tuned on (router/README.md), with seed SEED.
TUNING = Shape("tuning", 40, 5, 2, 600, 80, 80, 2000, 6, (0.2, 1.0))
SEED = 20261201
HELD_OUT = (
    # More prefix groups than prefills, none of them a document: affinity has little to balance against, and
    # round robin spreads each group over every prefill.
    Shape("support", 32, 6, 5, 300, 40, 120, 0, 0, (0.5, 2.0), start_spread_s=4.0),
    # One prefix for everyone, a third of the users pasting a long document, impatient users: balance matters most.
    Shape("documents", 36, 3, 1, 400, 60, 100, 3000, 3, (0.1, 0.5), start_spread_s=2.0),
    # Few users, long conversations with long answers: the histories, not the system prompts, make the reuse.
    Shape("long sessions", 16, 10, 3, 800, 60, 150, 1500, 8, (0.3, 1.5)),
)
HELD_OUT_SEEDS = (1, 2, 3)


@dataclass(frozen=True)
class Conversation:
    start_s: float  # when the user sends the first turn, from the start of the run
    system: str
    questions: tuple[str, ...]
    answers: tuple[str, ...]  # the assistant's turns as the history resends them (fixed: same for every policy)
    think_s: tuple[float, ...]  # pause after each answer


def _words(rng: random.Random, n: int) -> str:
    return " ".join("".join(rng.choice("bcdfghklmnprstvz") + rng.choice("aeiou") for _ in range(3)) for _ in range(n))


def workload(users: int, turns: int, seed: int = SEED, shape: Shape = TUNING) -> list[Conversation]:
    """The deterministic conversations of one run (``shape``'s own users and turns are the full run's; these
    override them). For ``TUNING`` the same conversations as before there were held-out shapes, seed for seed."""
    rng = random.Random(seed)
    systems = [f"system prompt {s}: " + _words(rng, shape.system_words) for s in range(shape.system_prompts)]

    def document(u: int, t: int) -> int:
        return shape.document_words if t == 0 and shape.document_every and u % shape.document_every == 0 else 0

    return [
        Conversation(
            start_s=rng.uniform(0, shape.start_spread_s),
            system=systems[u % shape.system_prompts],
            questions=tuple(
                f"user {u} turn {t}: " + _words(rng, shape.question_words + document(u, t)) for t in range(turns)
            ),
            answers=tuple(_words(rng, shape.answer_words) for _ in range(turns)),
            think_s=tuple(rng.uniform(*shape.think_s) for _ in range(turns)),
        )
        for u in range(users)
    ]


def messages(conv: Conversation, turn: int) -> list[dict[str, str]]:
    """The chat history a client sends for ``turn`` (0-based) of ``conv``."""
    out = [{"role": "system", "content": conv.system}]
    for t in range(turn):
        out += [{"role": "user", "content": conv.questions[t]}, {"role": "assistant", "content": conv.answers[t]}]
    return [*out, {"role": "user", "content": conv.questions[turn]}]
