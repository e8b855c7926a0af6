"""Scoring rules of canary rounds (the network part, ``probe``, is replaced by fixed answers here; the end-to-end
integrity tests run real canaries through simulated workers)."""

from __future__ import annotations

from prometheus_client import CollectorRegistry

from tandem.registry import Role
from tandem_router.canary import CanaryProber
from tandem_router.integrity.divergence import Answer
from tandem_router.integrity.monitor import IntegrityConfig, IntegrityMonitor
from tandem_router.integrity.quarantine import QuarantinePolicy
from tandem_router.pool import Pair, WorkerSpec
from tandem_router.transport import Transport

P = WorkerSpec(Role.PREFILL, "http://p0:1", 8998)
DECODES = [WorkerSpec(Role.DECODE, f"http://d{i}:2") for i in range(3)]
PAIRS = [Pair(P, d) for d in DECODES]


class FixedAnswers(CanaryProber):
    def __init__(self, monitor: IntegrityMonitor, answers: dict[str, str]) -> None:
        super().__init__(monitor, Transport(), lambda: PAIRS)
        self.answers = answers

    async def probe(self, pair: Pair, prompt: str) -> Answer | None:
        text = self.answers.get(pair.decode.url)
        return None if text is None else Answer(text)


def _monitor() -> IntegrityMonitor:
    return IntegrityMonitor(
        IntegrityConfig(policy=QuarantinePolicy(threshold=1, probe_initial_s=60)), CollectorRegistry()
    )


async def test_minority_answer_fails_and_quarantines_the_pair() -> None:
    monitor = _monitor()
    prober = FixedAnswers(monitor, {"http://d0:2": "good", "http://d1:2": "good", "http://d2:2": "garbled"})
    await prober.round()
    assert monitor.quarantined_keys() == {PAIRS[2].key}
    assert prober.references  # the majority answer became the reference


async def test_clean_round_answers_do_not_release_a_quarantined_pair() -> None:
    monitor = _monitor()
    monitor.failure(PAIRS[2].key, "prompt_leak")
    prober = FixedAnswers(monitor, {d.url: "good" for d in DECODES})
    for _ in range(5):
        await prober.round()
    assert monitor.quarantined_keys() == {PAIRS[2].key}  # only the scheduled burst re-probes can release it


async def test_no_majority_blames_nobody() -> None:
    monitor = _monitor()
    prober = FixedAnswers(monitor, {"http://d0:2": "a", "http://d1:2": "b", "http://d2:2": "c"})
    await prober.round()
    assert monitor.quarantined_keys() == frozenset()
