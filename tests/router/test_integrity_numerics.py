"""Canaries, shadows and probation under batch-variant GPU numerics: a NUMERICAL difference (a near-tied token
flipped, the rest diverging) never fails or blames a pair; a DIFFERENT one still does (fake workers answering
SGLang ``/generate`` bodies with logprobs; no simulator)."""

from __future__ import annotations

import asyncio
from typing import Any

import orjson
from prometheus_client import CollectorRegistry

from tandem.registry import Role
from tandem_router.app import integrity_config
from tandem_router.config import load
from tandem_router.dispatch import ProxyRequest
from tandem_router.integrity.divergence import NEAR_TIE_NATS, Answer
from tandem_router.integrity.monitor import IntegrityConfig, IntegrityMonitor
from tandem_router.integrity.probe_budget import ProbeKind
from tandem_router.integrity.quarantine import QuarantinePolicy
from tandem_router.openai.requests import ParsedRequest
from tandem_router.openai.schema import Route
from tandem_router.pool import Pair, WorkerPool, WorkerSpec
from tandem_router.probes.canary import CanaryProber
from tandem_router.probes.probation import ProbationMirror
from tandem_router.probes.shadow import ShadowSampler
from tandem_router.transport import Request, Transport
from tests.router.helpers import ample_budget, lone_router
from tests.router.test_integrity_divergence import FLIP, REF, Step, answer, generate_doc, sure, text_of, tied

P = WorkerSpec(Role.PREFILL, "http://p0:1", 8998)
D = [WorkerSpec(Role.DECODE, f"http://d{i}:2") for i in range(3)]
PAIRS = [Pair(P, d) for d in D]

LONG = [sure(w) for w in ("The", " sky", " over", " the", " old", " harbour", " town", " looks", " very", " pale")]
LATE_REF = [*LONG, tied(" blue", " clear"), sure(" during"), sure(" the"), sure(" day"), sure(".")]
LATE_FLIP = [*LONG, tied(" clear", " blue"), sure(" and"), sure(" bright"), sure(" today"), sure(".")]  # token 10
EARLY_FLIP = [sure("The"), tied(" air", " sky"), sure(" is"), sure(" cold")]  # token 1: "The sky ..." / "The air ..."
GARBLED = [*LONG, (" clear", -0.3, [(" clear", -0.3), (" mining", -1.0)]), sure(" quarterly"), sure(" report")]


def _monitor(**policy: Any) -> IntegrityMonitor:
    return IntegrityMonitor(
        IntegrityConfig(policy=QuarantinePolicy(threshold=1, probe_initial_s=60, **policy)), CollectorRegistry()
    )


def _count(monitor: IntegrityMonitor, metric: str, result: str) -> float:
    return monitor.metrics.registry.get_sample_value(f"tandem_integrity_{metric}_total", {"result": result}) or 0.0


def _body(steps: list[Step] | str) -> bytes:
    if isinstance(steps, str):
        return orjson.dumps({"text": steps})
    return orjson.dumps(generate_doc("".join(c for c, _, _ in steps), steps))


class _Reply:
    def __init__(self, body: bytes) -> None:
        self.status, self.body = 200, body

    async def __aenter__(self) -> _Reply:
        return self

    async def __aexit__(self, *_: object) -> None:
        return None

    async def read(self) -> bytes:
        return self.body


class FakeWorkers(Transport):
    """Decodes answer a fixed body per URL, or the next of ``queue`` in the order they are asked; prefills
    answer empty. Keeps the decode requests (URL and body) in order."""

    def __init__(self, by_url: dict[str, bytes] | None = None, queue: list[bytes] | None = None) -> None:
        super().__init__()
        self.by_url, self.queue = by_url or {}, queue or []
        self.asked: list[tuple[str, dict[str, Any]]] = []

    async def open(self, base_url: str, request: Request) -> Any:
        await asyncio.sleep(0.001)
        if base_url == P.url:
            return _Reply(b"{}")
        self.asked.append((base_url, orjson.loads(request.body)))
        return _Reply(self.by_url[base_url] if base_url in self.by_url else self.queue.pop(0))


# -- canaries --------------------------------------------------------------------------------------------------------


class FixedAnswers(CanaryProber):
    def __init__(self, monitor: IntegrityMonitor, answers: dict[str, Answer]) -> None:
        super().__init__(monitor, Transport(), lambda: PAIRS, ample_budget(monitor), lone_router())
        self.answers = answers

    async def probe(self, pair: Pair, prompt: str) -> Answer | None:
        return self.answers.get(pair.decode.url)


async def test_a_canary_answer_apart_by_numerics_passes_and_a_different_one_fails() -> None:
    monitor = _monitor()
    prober = FixedAnswers(monitor, {D[0].url: answer(REF), D[1].url: answer(FLIP), D[2].url: Answer("garbled")})
    await prober.round()
    assert monitor.quarantined_keys() == {PAIRS[2].key}
    assert [_count(monitor, "canaries", r) for r in ("pass", "numerical", "fail")] == [1, 1, 1]


async def test_a_pool_whose_answers_all_differ_by_numerics_fails_nobody() -> None:
    monitor = _monitor()
    third = [*REF[:5], sure(" during"), tied(" a", " the"), sure(" day")]
    prober = FixedAnswers(monitor, {D[0].url: answer(REF), D[1].url: answer(FLIP), D[2].url: answer(third)})
    await prober.round()
    assert monitor.quarantined_keys() == frozenset()
    assert _count(monitor, "canaries", "fail") == 0


async def test_bursts_compare_with_the_stored_reference_by_the_same_relation() -> None:
    monitor = _monitor()
    prober = FixedAnswers(monitor, {D[0].url: answer(REF), D[1].url: answer(REF), D[2].url: answer(FLIP)})
    await prober.round()
    assert _count(monitor, "canaries", "numerical") == 1
    await prober.burst(PAIRS[2], 4, ProbeKind.CONFIRMATION)  # numerical again: never a failure
    assert monitor.quarantined_keys() == frozenset()
    prober.answers[D[2].url] = Answer("The sky looks very quarterly report")
    await prober.burst(PAIRS[2], 1, ProbeKind.CONFIRMATION)
    assert monitor.quarantined_keys() == {PAIRS[2].key}


async def test_canary_probes_ask_for_the_top_two_logprobs() -> None:
    workers = FakeWorkers({d.url: _body(REF) for d in D})
    monitor = _monitor()
    prober = CanaryProber(monitor, workers, lambda: PAIRS, ample_budget(monitor), lone_router())
    got = await prober.probe(PAIRS[0], "Canary: a prompt")
    assert got is not None
    assert got.text == text_of(REF).text
    assert got.tokens is not None
    assert [t.text for t in got.tokens] == [c for c, _, _ in REF]
    [(_, body)] = workers.asked
    assert (body["return_logprob"], body["top_logprobs_num"], body["return_text_in_logprobs"]) == (True, 2, True)


# -- shadows ---------------------------------------------------------------------------------------------------------


def _pool(monitor: IntegrityMonitor) -> WorkerPool:
    pool = WorkerPool(gates=[monitor])
    for spec in (P, *D):
        pool.upsert(spec)
    monitor.set_pairs([p.key for p in PAIRS])
    return pool


def _request(i: int = 0, **extra: Any) -> ProxyRequest:
    body = {"text": f"prompt {i}", "sampling_params": {"temperature": 0, "max_new_tokens": 16}, **extra}
    return ProxyRequest(ParsedRequest.of(Route.GENERATE, body), "p", f"r{i}", 0.0, f"prompt {i}")


async def _shadow(
    client_text: str, second: list[Step] | str, third: list[Step] | str
) -> tuple[IntegrityMonitor, FakeWorkers]:
    """The client got ``client_text`` from d0's pair; the re-runs answer ``second`` then ``third``."""
    monitor = _monitor()
    workers = FakeWorkers(queue=[_body(second), _body(third)])
    sampler = ShadowSampler(monitor, workers, _pool(monitor), rate=1.0)
    req = _request(return_logprob=False, top_logprobs_num=7)
    before = orjson.dumps(req.parsed.body)
    sampler.completed(PAIRS[0], req, [client_text])
    await sampler.drain()
    assert orjson.dumps(req.parsed.body) == before  # the client's body is never changed
    for _, body in workers.asked:  # every re-run asked for the top two logprobs, on a copy
        assert (body["return_logprob"], body["top_logprobs_num"], body["return_text_in_logprobs"]) == (True, 2, True)
    return monitor, workers


async def test_a_shadow_apart_by_numerics_is_agreement() -> None:
    monitor, workers = await _shadow(text_of(REF).text, FLIP, "never asked")
    assert len(workers.asked) == 1  # no third pair needed
    assert monitor.quarantined_keys() == frozenset()
    assert _count(monitor, "shadows", "numerical") == 1


async def test_a_garbled_client_answer_blames_its_pair_when_two_others_agree_by_numerics() -> None:
    monitor, _ = await _shadow("The sky looks very quarterly report", FLIP, REF)
    assert _count(monitor, "shadows", "mismatch") == 1
    assert monitor.quarantined_keys() == {PAIRS[0].key}


async def test_a_garbling_second_pair_is_blamed_when_the_third_agrees_with_the_client_by_numerics() -> None:
    monitor, workers = await _shadow(text_of(REF).text, GARBLED, FLIP)
    second_url = workers.asked[0][0]
    assert monitor.quarantined_keys() == {next(p.key for p in PAIRS if p.decode.url == second_url)}


async def test_a_third_answer_that_agrees_with_both_blames_nobody() -> None:
    # The second parts from the client's text with a confident token (DIFFERENT), but the third flipped a near-tie
    # earlier and so agrees by numerics with both: nothing says which of the first two is wrong.
    second = [*REF[:5], sure(" during"), sure(" night")]
    monitor, workers = await _shadow(text_of(REF).text, second, FLIP)
    assert len(workers.asked) == 2
    assert _count(monitor, "shadows", "mismatch") == 1
    assert monitor.quarantined_keys() == frozenset()


# -- probation -------------------------------------------------------------------------------------------------------


async def _probation(
    bad: list[Step] | str, trusted_text: str, tiebreak: list[Step] | str, release_after: int = 20
) -> tuple[IntegrityMonitor, FakeWorkers]:
    """d0's pair on probation answers ``bad``; live answers (``trusted_text``) from d1's pair are mirrored to it;
    d2's pair breaks ties with ``tiebreak``."""
    monitor = _monitor(comparisons_to_release=release_after)
    pool = _pool(monitor)
    monitor.failure(PAIRS[0].key, "canary")
    monitor.book.start_probations(float("inf"))
    workers = FakeWorkers({D[0].url: _body(bad), D[1].url: _body(trusted_text), D[2].url: _body(tiebreak)})
    mirror = ProbationMirror(monitor, workers, pool)
    for i in range(10):
        mirror.completed(PAIRS[1], _request(i), [trusted_text])
        await asyncio.sleep(0.01)
        if not monitor.book.in_probation(PAIRS[0].key):
            break
    await asyncio.sleep(0.2)
    await mirror.drain()
    return monitor, workers


async def test_a_pair_on_probation_whose_answers_differ_by_numerics_is_released() -> None:
    monitor, _ = await _probation(LATE_FLIP, text_of(LATE_REF).text, LATE_REF)
    assert monitor.quarantined_keys() == frozenset()
    assert _count(monitor, "probation_comparisons", "numerical") >= 20
    assert _count(monitor, "probation_comparisons", "mismatch") == 0


async def test_a_flip_before_the_agreed_prefix_counts_neither_way() -> None:
    monitor, workers = await _probation(EARLY_FLIP, "The sky is cold", "The sky is cold")
    [view] = monitor.quarantined()
    assert view.probation
    assert view.clean_comparisons == 0
    assert _count(monitor, "probation_comparisons", "numerical_early") > 0
    assert not any(url == D[2].url for url, _ in workers.asked)  # nothing to break a tie on


async def test_a_garbling_pair_on_probation_is_sent_back_by_a_tiebreak_that_agrees_by_numerics() -> None:
    monitor, _ = await _probation(GARBLED, text_of(LATE_REF).text, LATE_FLIP)
    [view] = monitor.quarantined()
    assert not view.probation
    assert view.reason.startswith("failed on probation: mirrored answer differs from two trusted pairs")


async def test_a_tiebreak_that_agrees_with_neither_settles_nothing() -> None:
    monitor, _ = await _probation(GARBLED, text_of(LATE_REF).text, "Something else entirely.")
    [view] = monitor.quarantined()
    assert view.probation
    assert view.clean_comparisons == 0
    assert _count(monitor, "probation_comparisons", "inconclusive") > 0


def test_canary_bursts_on_probation_follow_the_agreed_prefix_rule() -> None:
    monitor = _monitor(comparisons_to_release=5)
    monitor.set_pairs([p.key for p in PAIRS])
    monitor.failure(PAIRS[0].key, "canary")
    monitor.book.start_probations(float("inf"))
    monitor.canary_result(PAIRS[0].key, True, numerical_at=3)
    assert monitor.quarantined()[0].clean_comparisons == 0
    monitor.canary_result(PAIRS[0].key, True, numerical_at=8)
    monitor.canary_result(PAIRS[0].key, True)
    assert monitor.quarantined()[0].clean_comparisons == 2


async def test_the_near_tie_flag_reaches_every_comparison() -> None:
    assert integrity_config(load([])).near_tie_nats == NEAR_TIE_NATS == 0.5
    cfg = integrity_config(load(["--integrity-near-tie-nats", "0.05"]))
    assert cfg.near_tie_nats == 0.05
    # REF / FLIP are 0.1 nats apart: numerics at the default, a difference under the tighter flag.
    monitor = IntegrityMonitor(cfg, CollectorRegistry())
    prober = FixedAnswers(monitor, {D[0].url: answer(REF), D[1].url: answer(REF), D[2].url: answer(FLIP)})
    await prober.round()
    assert _count(monitor, "canaries", "fail") == 1
