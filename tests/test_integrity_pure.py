"""Table tests of the integrity detectors, quarantine rules and canary consensus (pure, no I/O)."""

from __future__ import annotations

import pytest

from tandem_router.integrity.consensus import judge
from tandem_router.integrity.detectors import (
    Finding,
    PromptLeakIndex,
    find_bad_text,
    find_repetition_loop,
)
from tandem_router.integrity.quarantine import IntegrityBook, QuarantinePolicy, Transition

PROMPT_A = "please summarise the quarterly report of the northern mining company for the board meeting tomorrow"
PROMPT_B = "write a haiku about autumn leaves falling slowly over the quiet river near the old mill house"


def test_leak_of_another_prompt_is_found() -> None:
    index = PromptLeakIndex(ngram=6)
    index.add("a", PROMPT_A)
    index.add("b", PROMPT_B)
    garbled = "sure here it is autumn leaves falling slowly over the quiet river and more"
    found = index.check("a", PROMPT_A, garbled)
    assert found is not None
    assert found.finding is Finding.PROMPT_LEAK
    assert "autumn leaves falling slowly over the" in found.detail


def test_echoing_own_prompt_is_not_a_leak() -> None:
    index = PromptLeakIndex(ngram=6)
    index.add("a", PROMPT_A)
    index.add("b", PROMPT_A + " extra words")  # a shared prefix (same system prompt) is common
    assert index.check("a", PROMPT_A, "you asked me to " + PROMPT_A) is None


def test_discarded_prompt_no_longer_counts() -> None:
    index = PromptLeakIndex(ngram=6)
    index.add("b", PROMPT_B)
    index.discard("b")
    assert len(index) == 0
    assert index.check("a", PROMPT_A, PROMPT_B) is None


def test_index_is_bounded() -> None:
    index = PromptLeakIndex(ngram=2, max_prompts=3)
    for i in range(10):
        index.add(str(i), f"w{i} x{i} y{i}")
    assert len(index) == 3
    assert index.check("new", "", "w0 x0") is None  # evicted
    assert index.check("new", "", "w9 x9") is not None


def test_short_output_is_never_a_leak() -> None:
    index = PromptLeakIndex(ngram=8)
    index.add("b", PROMPT_B)
    assert index.check("a", PROMPT_A, "autumn leaves") is None


@pytest.mark.parametrize(
    ("text", "looping"),
    [
        ("the cat sat on the mat and then went to sleep by the fire " * 1, False),
        ("go " * 30, True),
        ("intro words here " + "river near the old mill " * 6, True),
        ("river near the old mill " * 3, False),  # 3 repeats: under min_repeats
        ("ab cd " * 5, False),  # 10 words: under min_span_words
        ("one two three four five six seven eight nine ten eleven twelve thirteen " * 5, True),
    ],
)
def test_repetition_loop(text: str, looping: bool) -> None:
    assert (find_repetition_loop(text) is not None) is looping


@pytest.mark.parametrize(
    ("text", "bad"),
    [
        ("plain text\nwith newline\tand tab", False),
        ("broken \ufffd byte", True),
        ("bell \x07 char", True),
        ("leaked <|im_end|> token", True),
        ("a < b and c > d", False),
    ],
)
def test_bad_text(text: str, bad: bool) -> None:
    assert (find_bad_text(text) is not None) is bad


PAIR = ("http://p0", "http://d0")
POLICY = QuarantinePolicy(threshold=2, window_s=10, probe_initial_s=1, probe_max_s=4, clean_probes_to_release=2)


def test_quarantine_after_threshold_within_window() -> None:
    book = IntegrityBook(POLICY)
    assert book.record_failure(PAIR, "leak", now=0.0) is None
    assert book.record_failure(PAIR, "leak", now=20.0) is None  # first one aged out of the window
    assert book.record_failure(PAIR, "loop", now=25.0) is Transition.QUARANTINED
    assert book.is_quarantined(PAIR)
    [view] = book.quarantined()
    assert (view.prefill, view.decode, view.reason, view.since) == ("http://p0", "http://d0", "loop", 25.0)
    assert book.totals(PAIR) == (3, 1)


def test_reprobe_backoff_and_release() -> None:
    book = IntegrityBook(POLICY)
    book.record_failure(PAIR, "x", 0.0)
    book.record_failure(PAIR, "x", 0.0)
    assert book.probes_due(0.5) == []
    assert book.probes_due(1.0) == [PAIR]
    assert book.record_probe(PAIR, clean=False, now=1.0) is None  # interval 1 -> 2
    assert book.probes_due(2.9) == []
    assert book.record_probe(PAIR, clean=False, now=3.0) is None  # 2 -> 4
    assert book.record_probe(PAIR, clean=False, now=7.0) is None  # capped at 4
    assert book.probes_due(10.9) == []
    assert book.record_probe(PAIR, clean=True, now=11.0) is None  # 1 of 2 clean
    assert book.probes_due(11.0) == [PAIR]  # confirmation probe right away
    assert book.record_probe(PAIR, clean=True, now=11.1) is Transition.RELEASED
    assert not book.is_quarantined(PAIR)


def test_dirty_probe_resets_clean_streak() -> None:
    book = IntegrityBook(POLICY)
    book.record_failure(PAIR, "x", 0.0)
    book.record_failure(PAIR, "x", 0.0)
    book.record_probe(PAIR, clean=True, now=1.0)
    book.record_probe(PAIR, clean=False, now=1.0)
    assert book.record_probe(PAIR, clean=True, now=5.0) is None
    assert book.is_quarantined(PAIR)


def test_worker_quarantined_only_when_all_its_pairs_are() -> None:
    book = IntegrityBook(QuarantinePolicy(threshold=1))
    pairs = [("p0", "d0"), ("p1", "d0"), ("p0", "d1"), ("p1", "d1")]
    book.record_failure(("p0", "d0"), "x", 0.0)
    assert book.quarantined_workers(pairs) == set()
    book.record_failure(("p1", "d0"), "x", 0.0)
    assert book.quarantined_workers(pairs) == {"d0"}


def test_policy_validation() -> None:
    with pytest.raises(ValueError, match="threshold"):
        QuarantinePolicy(threshold=0)
    with pytest.raises(ValueError, match="probe_initial_s"):
        QuarantinePolicy(probe_initial_s=10, probe_max_s=1)


@pytest.mark.parametrize(
    ("answers", "reference", "failed"),
    [
        ({("p", "d0"): "x", ("p", "d1"): "x", ("p", "d2"): "y"}, "x", {("p", "d2")}),
        ({("p", "d0"): "x", ("p", "d1"): "y"}, None, set()),  # no strict majority: nobody blamed
        ({}, None, set()),
    ],
)
def test_consensus(answers: dict[tuple[str, str], str], reference: str | None, failed: set[tuple[str, str]]) -> None:
    verdict = judge(answers)
    assert verdict.reference == reference
    assert verdict.failed == failed
    assert verdict.passed == frozenset(answers) - failed if reference else verdict.passed == frozenset()


def test_explicit_reference_wins_over_majority() -> None:
    verdict = judge({("p", "d0"): "bad", ("p", "d1"): "bad", ("p", "d2"): "good"}, reference="good")
    assert verdict.failed == {("p", "d0"), ("p", "d1")}


def test_probation_after_release_requarantines_on_one_failure_with_longer_backoff() -> None:
    policy = QuarantinePolicy(threshold=2, window_s=10, probe_initial_s=1, probe_max_s=100, probation_s=50)
    book = IntegrityBook(policy)
    book.record_failure(PAIR, "x", 0.0)
    book.record_failure(PAIR, "x", 0.0)
    book.record_probe(PAIR, clean=True, now=1.0)
    assert book.record_probe(PAIR, clean=True, now=1.0) is Transition.RELEASED
    assert book.record_failure(PAIR, "again", now=20.0) is Transition.QUARANTINED  # one failure on probation
    assert book.probes_due(21.9) == []  # second quarantine: interval 2 s, not 1 s
    assert book.probes_due(22.0) == [PAIR]
    book.record_probe(PAIR, clean=True, now=22.0)
    book.record_probe(PAIR, clean=True, now=22.0)
    assert book.record_failure(PAIR, "late", now=80.0) is None  # probation over: back to the threshold


def test_failures_of_one_worker_with_two_partners_quarantine_all_its_pairs() -> None:
    book = IntegrityBook(QuarantinePolicy(threshold=2, window_s=10, worker_spread=2))
    known = [("p0", "d0"), ("p1", "d0"), ("p2", "d0"), ("p0", "d1"), ("p1", "d1"), ("p2", "d1")]
    assert book.record_failure(("p0", "d0"), "leak", 0.0) is None
    assert book.spread_to_workers(("p0", "d0"), known, "leak", 0.0) == []
    assert book.record_failure(("p1", "d0"), "leak", 1.0) is None
    newly = book.spread_to_workers(("p1", "d0"), known, "leak", 1.0)
    assert sorted(newly) == [("p0", "d0"), ("p1", "d0"), ("p2", "d0")]  # d0 is the common factor
    assert book.quarantined_workers(known) == {"d0"}
    assert not book.is_quarantined(("p0", "d1"))
    assert "d0 failed with 2 partners" in book.quarantined()[0].reason


def test_spread_needs_failures_within_the_window() -> None:
    book = IntegrityBook(QuarantinePolicy(threshold=5, window_s=10, worker_spread=2))
    known = [("p0", "d0"), ("p1", "d0")]
    book.record_failure(("p0", "d0"), "x", 0.0)
    book.record_failure(("p1", "d0"), "x", 30.0)
    assert book.spread_to_workers(("p1", "d0"), known, "x", 30.0) == []
