"""Integrity at fleet scale (issue #40): quarantines shared between the routers of a cluster, and a lone pair
(1 x 1) checked against itself: shadows re-run on the same pair, canaries judged against the pair's own known
answer. No network: fake workers and fixed answers."""

from __future__ import annotations

import asyncio
from typing import Any

from prometheus_client import CollectorRegistry

from tandem.registry import Role
from tandem_router.integrity.divergence import Answer
from tandem_router.integrity.monitor import IntegrityConfig, IntegrityMonitor
from tandem_router.integrity.quarantine import IntegrityBook, QuarantinePolicy
from tandem_router.pool import Pair, WorkerPool, WorkerSpec
from tandem_router.probes.canary import CanaryProber, ProbeScope
from tandem_router.probes.publisher import SHARED_PREFIX, report_of
from tandem_router.probes.shadow import ShadowSampler
from tandem_router.transport import Transport
from tests.router.helpers import ample_budget, lone_router
from tests.router.test_integrity_divergence import FLIP, PREFIX, REF, answer, sure, text_of
from tests.router.test_integrity_numerics import FakeWorkers, _body, _Reply, _request

PAIRS4 = [(f"prefill:http://p{i}", f"decode:http://d{j}") for i in range(2) for j in range(2)]
D1 = [p for p in PAIRS4 if p[1] == "decode:http://d1"]


def _monitor(**policy: Any) -> IntegrityMonitor:
    monitor = IntegrityMonitor(IntegrityConfig(policy=QuarantinePolicy(**policy)), CollectorRegistry())
    monitor.set_pairs(PAIRS4)
    return monitor


# -- what is shared ---------------------------------------------------------------------------------------------------


def test_a_quarantine_on_a_comparison_is_shared_and_one_on_findings_alone_is_not() -> None:
    book = IntegrityBook(QuarantinePolicy(threshold=1))
    book.record_failure(PAIRS4[0], "leak", 0.0, PAIRS4, detector_only=True)  # independent clients' findings
    book.record_failure(PAIRS4[3], "canary answer differs", 0.0, PAIRS4)
    shared = {(q.prefill, q.decode): q.shared for q in book.quarantined()}
    assert shared == {PAIRS4[0]: False, PAIRS4[3]: True}


def test_a_worker_conviction_anchored_on_a_comparison_is_shared() -> None:
    """d1 failed a shadow comparison with p0; a detector finding with p1 then spreads to all d1's pairs: the
    conviction rests on the comparison, so it is shared."""
    book = IntegrityBook(QuarantinePolicy(threshold=2))
    assert book.record_failure(D1[0], "shadow mismatch", 0.0, PAIRS4).newly == ()
    outcome = book.record_failure(D1[1], "leak", 1.0, PAIRS4, detector_only=True)
    assert set(outcome.newly) == set(D1)
    assert all(q.shared for q in book.quarantined())


def test_an_adopted_quarantine_is_not_shared_again_nor_counted_for_repeat_offenders() -> None:
    book = IntegrityBook(QuarantinePolicy(report_after=1))
    assert book.adopt(D1[0], "from b", 0.0, PAIRS4) == (D1[0],)
    assert book.is_quarantined(D1[0])
    assert book.adopt(D1[0], "from c", 0.0, PAIRS4) == ()  # out already
    assert [q.shared for q in book.quarantined()] == [False]
    assert book.repeat_offenders(PAIRS4) == {}


def test_the_report_marks_shared_quarantines_in_the_reason() -> None:
    monitor = _monitor(threshold=1)
    monitor.failure(D1[0], "canary answer differs")
    report = report_of(monitor, "router-a", 0.0)
    assert [q.reason for q in report.quarantined] == [f"{SHARED_PREFIX}canary answer differs"]


# -- adopting --------------------------------------------------------------------------------------------------------


def test_a_shared_quarantine_is_adopted_once_per_entry() -> None:
    monitor = _monitor(probe_initial_s=1, comparisons_to_release=1)
    entry = {D1[0]: frozenset({"router-b: canary answer differs"})}
    assert monitor.adopt(entry) == [D1[0]]
    assert monitor.quarantined_keys() == {D1[0]}
    # Released here on probation while b still reports it: the same entry does not take it out again.
    monitor.book.start_probations(monitor.clock() + 10)
    monitor.comparison(D1[0], True)
    assert monitor.quarantined_keys() == frozenset()
    assert monitor.adopt(entry) == []
    # b quarantined it anew (a new entry): adopted again.
    assert monitor.adopt({D1[0]: frozenset({"router-b: failed on probation: x"})}) == [D1[0]]


def test_an_adopted_pair_convicts_its_decode_with_one_failure_here() -> None:
    """Another router quarantined (p0, d1) on a comparison: here d1's other pairs are under suspicion at once, and
    one failure of one of them convicts d1 (its pairs fail with two partners), shared in turn."""
    monitor = _monitor(threshold=2)
    monitor.adopt({D1[0]: frozenset({"router-b: shadow: text differs"})})
    assert monitor.under_suspicion(D1[1])
    monitor.failure(D1[1], "shadow: text differs from two other pairs")
    assert monitor.quarantined_keys() == set(D1)
    assert {(q.prefill, q.decode) for q in monitor.quarantined() if q.shared} == {D1[1]}


def test_pairs_of_one_decode_shared_by_two_routers_convict_the_decode() -> None:
    """Router b quarantined (p0, d1), router c (p1, d1), each on one comparison: together d1 failed with two
    prefills, so it is the culprit here, with all its pairs (shared in turn); d0's pairs stay."""
    pairs = [(f"prefill:http://p{i}", f"decode:http://d{j}") for i in range(3) for j in range(2)]
    monitor = _monitor(threshold=2)
    monitor.set_pairs(pairs)
    d1 = [p for p in pairs if p[1] == "decode:http://d1"]
    adopted = monitor.adopt({d1[0]: frozenset({"router-b: shadow"}), d1[1]: frozenset({"router-c: canary"})})
    assert set(adopted) == set(d1)
    assert monitor.quarantined_keys() == set(d1)
    assert {(q.prefill, q.decode) for q in monitor.quarantined() if q.shared} == {d1[2]}


def test_a_shared_pair_this_router_cannot_form_waits() -> None:
    monitor = _monitor()
    unknown = ("prefill:http://p9", "decode:http://d1")
    entry = {unknown: frozenset({"router-b: canary answer differs"})}
    assert monitor.adopt(entry) == []
    monitor.set_pairs([*PAIRS4, unknown])
    assert monitor.adopt(entry) == [unknown]


class Recorded(CanaryProber):
    def __init__(self, monitor: IntegrityMonitor, scope: ProbeScope, pairs: list[Pair]) -> None:
        super().__init__(monitor, Transport(), lambda: pairs, ample_budget(monitor), scope)
        self.probed: list[tuple[str, str]] = []

    async def probe(self, pair: Pair, prompt: str) -> Answer | None:
        self.probed.append(pair.key)
        return Answer("good")


PS = [WorkerSpec(Role.PREFILL, f"http://p{i}", 8998) for i in range(2)]
DS = [WorkerSpec(Role.DECODE, f"http://d{j}") for j in range(2)]
POOL_PAIRS = [Pair(p, d) for p in PS for d in DS]


async def test_the_prober_adopts_shared_peer_quarantines_and_confirms_the_others() -> None:
    monitor = _monitor()
    shared, findings_only = D1[0], PAIRS4[0]
    peers = {shared: frozenset({"router-b: shadow: text differs"}), findings_only: frozenset()}
    prober = Recorded(monitor, ProbeScope("a", lambda: {"a", "b"}, lambda pair: False, lambda: peers), POOL_PAIRS)
    await prober.round()  # a reference to burst with
    prober.probed.clear()
    prober.confirm_peer_quarantines()
    await prober.drain()
    assert monitor.quarantined_keys() == {shared}  # at once, no evidence of its own needed
    assert set(prober.probed) == {findings_only}  # the other is only confirmed here
    assert monitor.under_suspicion(findings_only)


# -- a lone pair ------------------------------------------------------------------------------------------------------

P0 = WorkerSpec(Role.PREFILL, "http://p0:1", 8998)
D0 = WorkerSpec(Role.DECODE, "http://d0:2")
LONE = Pair(P0, D0)
GARBLED = "The sky looks very quarterly report"


def _lone_monitor() -> IntegrityMonitor:
    return IntegrityMonitor(
        IntegrityConfig(policy=QuarantinePolicy(threshold=1, probe_initial_s=60)), CollectorRegistry()
    )


def _lone_pool(monitor: IntegrityMonitor) -> WorkerPool:
    pool = WorkerPool(gates=[monitor])
    for spec in (P0, D0):
        pool.upsert(spec)
    monitor.set_pairs([LONE.key])
    return pool


async def _lone_shadow(client_text: str, reruns: list[Any], **body: Any) -> tuple[IntegrityMonitor, FakeWorkers]:
    monitor = _lone_monitor()
    workers = FakeWorkers(queue=[_body(r) for r in reruns])
    sampler = ShadowSampler(monitor, workers, _lone_pool(monitor), rate=1.0)
    sampler.completed(LONE, _request(**body), [client_text])
    await sampler.drain()
    return monitor, workers


async def test_a_lone_pair_that_contradicts_itself_fails() -> None:
    monitor, workers = await _lone_shadow(GARBLED, [FLIP, REF])
    assert [url for url, _ in workers.asked] == [D0.url, D0.url]  # both re-runs on the pair itself
    assert monitor.quarantined_keys() == {LONE.key}


async def test_a_lone_pair_whose_re_runs_contradict_each_other_fails() -> None:
    """All three answers differ (the pair garbles most of them): which one is right does not matter, the pair
    contradicted itself in two answers the router asked for with logprobs."""
    other_garbled = [*PREFIX, sure(" mining"), sure(" company"), sure(" report")]
    monitor, _ = await _lone_shadow(GARBLED, [FLIP, other_garbled])
    assert monitor.quarantined_keys() == {LONE.key}


async def test_three_pairs_whose_answers_all_differ_blame_nobody() -> None:
    """Between pairs the same disagreement does not say which pair is wrong: nobody is blamed (unchanged)."""
    other_garbled = [*PREFIX, sure(" mining"), sure(" company"), sure(" report")]
    monitor = _lone_monitor()
    decodes = [WorkerSpec(Role.DECODE, f"http://d{j}:2") for j in range(3)]
    pool = WorkerPool(gates=[monitor])
    for spec in (P0, *decodes):
        pool.upsert(spec)
    monitor.set_pairs([p.key for p in pool.all_pairs()])
    workers = FakeWorkers(queue=[_body(FLIP), _body(other_garbled)])
    sampler = ShadowSampler(monitor, workers, pool, rate=1.0)
    sampler.completed(Pair(P0, decodes[0]), _request(), [GARBLED])
    await sampler.drain()
    assert len(workers.asked) == 2
    assert monitor.quarantined_keys() == frozenset()


async def test_a_lone_pair_whose_answers_differ_by_numerics_passes() -> None:
    monitor, workers = await _lone_shadow(text_of(REF).text, [FLIP])
    assert len(workers.asked) == 1
    assert monitor.quarantined_keys() == frozenset()


async def test_a_lone_pair_is_not_compared_with_itself_on_sampled_requests() -> None:
    seeded = {"sampling_params": {"temperature": 0.7, "sampling_seed": 3, "max_new_tokens": 16}}
    monitor, workers = await _lone_shadow(GARBLED, [FLIP, REF], **seeded)
    assert workers.asked == []
    assert monitor.quarantined_keys() == frozenset()


class Cycling(CanaryProber):
    """One pair; its canary answers are taken in turn from ``answers``."""

    def __init__(self, monitor: IntegrityMonitor, answers: list[Answer]) -> None:
        super().__init__(monitor, Transport(), lambda: [LONE], ample_budget(monitor), lone_router())
        self.answers, self.asked = answers, 0

    async def probe(self, pair: Pair, prompt: str) -> Answer | None:
        self.asked += 1
        return self.answers[(self.asked - 1) % len(self.answers)]


async def test_a_lone_pair_gets_a_known_answer_from_its_own_majority() -> None:
    monitor = _lone_monitor()
    monitor.set_pairs([LONE.key])
    prober = Cycling(monitor, [answer(REF), answer(FLIP), answer(REF)])  # apart by numerics only
    await prober.round()
    assert prober.asked == 3
    assert monitor.quarantined_keys() == frozenset()
    assert len(prober.references) == 1
    # The next round of the same prompt is judged against that known answer with one probe.
    prober.answers = [Answer(GARBLED)]
    prober._round = 0
    await prober.round()
    assert prober.asked == 4
    assert monitor.quarantined_keys() == {LONE.key}


async def test_a_lone_pair_whose_canary_answers_disagree_fails() -> None:
    monitor = _lone_monitor()
    monitor.set_pairs([LONE.key])
    await Cycling(monitor, [answer(REF), answer(REF), Answer(GARBLED)]).round()
    assert monitor.quarantined_keys() == {LONE.key}


# -- convicting a decode --------------------------------------------------------------------------------------------


class ByDecode(Transport):
    """Prefills answer empty; each decode answers its fixed body. Keeps the decode URLs asked, in order."""

    def __init__(self, bodies: dict[str, bytes]) -> None:
        super().__init__()
        self.bodies = bodies
        self.asked: list[str] = []

    async def open(self, base_url: str, request: Any) -> Any:
        await asyncio.sleep(0.001)
        if base_url not in self.bodies:
            return _Reply(b"{}")
        self.asked.append(base_url)
        return _Reply(self.bodies[base_url])


async def _garbled_on_d0(body: dict[str, Any] | None = None) -> tuple[IntegrityMonitor, ByDecode]:
    """Three prefills x three decodes; the client's answer through (p0, d0) was garbled and d0 garbles every
    answer; a sampled shadow re-runs it (on d1, then d2)."""
    prefills = [WorkerSpec(Role.PREFILL, f"http://p{i}:1", 8998 + i) for i in range(3)]
    decodes = [WorkerSpec(Role.DECODE, f"http://d{j}:2") for j in range(3)]
    monitor = IntegrityMonitor(IntegrityConfig(policy=QuarantinePolicy(threshold=2)), CollectorRegistry())
    pool = WorkerPool(gates=[monitor])
    for spec in (*prefills, *decodes):
        pool.upsert(spec)
    monitor.set_pairs([p.key for p in pool.all_pairs()])
    workers = ByDecode({decodes[0].url: _body(GARBLED), decodes[1].url: _body(REF), decodes[2].url: _body(FLIP)})
    sampler = ShadowSampler(monitor, workers, pool, rate=1.0)
    sampler.completed(Pair(prefills[0], decodes[0]), _request(**(body or {})), [GARBLED])
    await sampler.drain()
    return monitor, workers


async def test_a_failed_answer_is_re_run_through_its_decode_s_other_pairs_which_convicts_it() -> None:
    monitor, workers = await _garbled_on_d0()
    d0 = {key for key in monitor.book_pairs() if key[1] == "decode:http://d0:2"}
    assert monitor.quarantined_keys() == d0  # its failures span two prefills: the decode is the culprit
    assert workers.asked.count("http://d0:2") == 2  # the other two pairs of d0, once each


async def test_a_sampled_request_is_not_re_run_to_convict() -> None:
    seeded = {"sampling_params": {"temperature": 0.7, "sampling_seed": 3, "max_new_tokens": 16}}
    monitor, workers = await _garbled_on_d0(seeded)
    assert "http://d0:2" not in workers.asked
    assert len(monitor.quarantined_keys()) <= 1  # at most the failed pair; d0 is not convicted on it
