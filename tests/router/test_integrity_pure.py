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
from tandem_router.integrity.divergence import Answer
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


@pytest.mark.parametrize(
    ("prompt", "text"),
    [
        ("please repeat \ufffd \ufffd \ufffd", "\ufffd \ufffd \ufffd"),
        ("echo this: bell \x07 bell", "bell \x07 bell"),
        ("say <|im_end|> please", "<|im_end|>"),
    ],
)
def test_bad_text_that_was_in_the_prompt_is_not_evidence(prompt: str, text: str) -> None:
    assert find_bad_text(text, prompt) is None
    assert find_bad_text(text + " \x01", prompt) is not None  # a control character the prompt did not have


def test_repeats_of_a_phrase_from_the_prompt_are_not_evidence() -> None:
    prompt = "repeat after me forty times: river near the old mill"
    assert find_repetition_loop("river near the old mill " * 8, prompt=prompt) is None
    assert find_repetition_loop("quiet autumn leaves falling " * 8, prompt=prompt) is not None


def test_leak_reports_whose_prompt_leaked() -> None:
    index = PromptLeakIndex(ngram=8)
    index.add("b", PROMPT_B)
    found = index.check("a", PROMPT_A, "so " + PROMPT_B)
    assert found is not None
    assert found.sources == {"b"}
    # Another request's prompt pasted into one's own prompt is one's own prompt.
    assert index.check("c", "repeat: " + PROMPT_B, PROMPT_B) is None


PAIR = ("http://p0", "http://d0")
POLICY = QuarantinePolicy(threshold=2, window_s=10, probe_initial_s=1, probe_max_s=4, comparisons_to_release=3)
FOUR = [("p0", "d0"), ("p1", "d0"), ("p0", "d1"), ("p1", "d1")]


def _quarantine(book: IntegrityBook, pair: tuple[str, str] = PAIR, now: float = 0.0) -> None:
    book.record_failure(pair, "x", now, [pair])
    assert book.record_failure(pair, "x", now, [pair]).newly == (pair,)


def test_quarantine_after_threshold_within_window() -> None:
    book = IntegrityBook(POLICY)
    assert book.record_failure(PAIR, "leak", 0.0, [PAIR]).newly == ()
    assert book.record_failure(PAIR, "leak", 20.0, [PAIR]).newly == ()  # first one aged out of the window
    assert book.record_failure(PAIR, "loop", 25.0, [PAIR]).newly == (PAIR,)
    assert book.is_quarantined(PAIR)
    [view] = book.quarantined()
    assert (view.prefill, view.decode, view.reason, view.since) == ("http://p0", "http://d0", "loop", 25.0)
    assert book.totals(PAIR) == (3, 1)


def test_probation_releases_after_clean_comparisons_only() -> None:
    book = IntegrityBook(POLICY)
    _quarantine(book)
    assert book.start_probations(0.9) == []
    assert book.start_probations(1.0) == [PAIR]
    assert book.is_quarantined(PAIR)
    assert book.in_probation(PAIR)
    assert book.record_comparison(PAIR, True, 1.1) is None
    assert book.record_comparison(PAIR, True, 1.2) is None
    assert book.record_comparison(PAIR, True, 1.3) is Transition.RELEASED
    assert not book.is_quarantined(PAIR)


def test_mismatch_on_probation_requarantines_with_exponential_backoff() -> None:
    book = IntegrityBook(QuarantinePolicy(probe_initial_s=1, probe_max_s=4, comparisons_to_release=2))
    _quarantine(book)
    waits = []
    now = 0.0
    for _ in range(4):
        [view] = book.quarantined()
        waits.append(view.next_probe_at - now)
        now = view.next_probe_at
        assert book.start_probations(now) == [PAIR]
        book.record_comparison(PAIR, True, now)
        assert book.record_comparison(PAIR, False, now, "garbled") is Transition.QUARANTINED
        assert not book.in_probation(PAIR)
        assert book.is_quarantined(PAIR)
    assert waits == [1, 2, 4, 4]  # doubles per quarantine, capped at probe_max_s
    assert "failed on probation: garbled" in book.quarantined()[0].reason


def test_failure_during_watch_after_release_requarantines_at_once() -> None:
    book = IntegrityBook(
        QuarantinePolicy(threshold=2, window_s=10, probe_initial_s=1, comparisons_to_release=1, watch_s=50)
    )
    _quarantine(book)
    book.start_probations(1.0)
    assert book.record_comparison(PAIR, True, 1.0) is Transition.RELEASED
    assert book.record_failure(PAIR, "again", 20.0, [PAIR]).newly == (PAIR,)  # one failure while watched
    [view] = book.quarantined()
    assert view.next_probe_at == 22.0  # second quarantine: 2 s, not 1 s
    book.start_probations(22.0)
    book.record_comparison(PAIR, True, 22.0)
    assert book.record_failure(PAIR, "late", 80.0, [PAIR]).newly == ()  # watch over: back to the threshold


def test_worker_quarantined_only_when_all_its_pairs_are() -> None:
    book = IntegrityBook(QuarantinePolicy(threshold=1))
    book.record_failure(("p0", "d0"), "x", 0.0, [("p0", "d0")])
    assert book.quarantined_workers(FOUR) == set()
    book.record_failure(("p1", "d0"), "x", 100.0, [("p1", "d0")])
    assert book.quarantined_workers(FOUR) == {"d0"}


def test_policy_validation() -> None:
    with pytest.raises(ValueError, match="threshold"):
        QuarantinePolicy(threshold=0)
    with pytest.raises(ValueError, match="probe_initial_s"):
        QuarantinePolicy(probe_initial_s=10, probe_max_s=1)
    with pytest.raises(ValueError, match="max_detector_share"):
        QuarantinePolicy(max_detector_share=0)


@pytest.mark.parametrize(
    ("answers", "reference", "failed"),
    [
        ({("p", "d0"): "x", ("p", "d1"): "x", ("p", "d2"): "y"}, "x", {("p", "d2")}),
        ({("p", "d0"): "x", ("p", "d1"): "y"}, None, set()),  # no strict majority: nobody blamed
        ({}, None, set()),
    ],
)
def test_consensus(answers: dict[tuple[str, str], str], reference: str | None, failed: set[tuple[str, str]]) -> None:
    verdict = judge({pair: Answer(text) for pair, text in answers.items()})
    assert (verdict.reference.text if verdict.reference is not None else None) == reference
    assert verdict.failed == failed
    assert verdict.passed == frozenset(answers) - failed if reference else verdict.passed == frozenset()


def test_explicit_reference_wins_over_majority() -> None:
    answers = {("p", "d0"): Answer("bad"), ("p", "d1"): Answer("bad"), ("p", "d2"): Answer("good")}
    verdict = judge(answers, reference=Answer("good"))
    assert verdict.failed == {("p", "d0"), ("p", "d1")}


def test_failures_of_one_worker_with_two_partners_quarantine_all_its_pairs() -> None:
    book = IntegrityBook(QuarantinePolicy(threshold=2, window_s=10, worker_spread=2))
    known = [("p0", "d0"), ("p1", "d0"), ("p2", "d0"), ("p0", "d1"), ("p1", "d1"), ("p2", "d1")]
    assert book.record_failure(("p0", "d0"), "leak", 0.0, known).newly == ()
    newly = book.record_failure(("p1", "d0"), "leak", 1.0, known).newly
    assert sorted(newly) == [("p0", "d0"), ("p1", "d0"), ("p2", "d0")]  # d0 is the common factor
    assert book.quarantined_workers(known) == {"d0"}
    assert not book.is_quarantined(("p0", "d1"))
    assert "d0 failed with 2 partners" in book.quarantined()[0].reason


def test_spread_needs_failures_within_the_window() -> None:
    book = IntegrityBook(QuarantinePolicy(threshold=5, window_s=10, worker_spread=2))
    known = [("p0", "d0"), ("p1", "d0")]
    book.record_failure(("p0", "d0"), "x", 0.0, known)
    assert book.record_failure(("p1", "d0"), "x", 30.0, known).newly == ()


@pytest.mark.parametrize(("share", "allowed"), [(0.5, 2), (0.25, 1), (0.1, 1), (1.0, 4)])
def test_detector_only_failures_stop_at_the_share_cap(share: float, allowed: int) -> None:
    book = IntegrityBook(QuarantinePolicy(threshold=1, max_detector_share=share))
    held = []
    for pair in FOUR:
        outcome = book.record_failure(pair, "x", 100.0 * FOUR.index(pair), FOUR, detector_only=True)
        held.append(outcome.held_by_share_cap)
    assert book.quarantined_share(FOUR) == allowed / 4
    assert held == [False] * allowed + [True] * (4 - allowed)
    # Past the cap, a confirmed failure (canary or shadow) still quarantines.
    last = FOUR[-1]
    if book.is_quarantined(last):
        return
    assert book.record_failure(last, "canary", 1000.0, FOUR).newly == (last,)


def test_repeat_offender_is_a_worker_all_of_whose_pairs_keep_failing() -> None:
    book = IntegrityBook(QuarantinePolicy(threshold=1, probe_initial_s=1, report_after=3))
    now = 0.0
    for pair in FOUR[:2]:  # d0's pairs
        book.record_failure(pair, "x", now, FOUR)
    for _ in range(2):  # two failed probations each
        now += 100
        for pair in book.start_probations(now):
            book.record_comparison(pair, False, now, "mirror mismatch")
    assert book.repeat_offenders(FOUR) == {"d0": (3, "failed on probation: mirror mismatch")}


def test_quarantines_on_text_findings_alone_never_make_a_repeat_offender() -> None:
    book = IntegrityBook(QuarantinePolicy(threshold=1, probe_initial_s=1, report_after=2, comparisons_to_release=1))
    now = 0.0
    for _ in range(5):  # several independent clients keep provoking findings; probation finds the pair clean
        now += 1000
        book.record_failure(FOUR[0], "bad_text", now, FOUR, detector_only=True)
        book.start_probations(now + 500)
        assert book.record_comparison(FOUR[0], True, now + 500) is Transition.RELEASED
    assert book.totals(FOUR[0]) == (5, 5)
    assert book.repeat_offenders(FOUR) == {}


def test_one_confirmed_failure_of_a_pair_another_router_quarantined_quarantines_it_and_its_worker() -> None:
    """Another router quarantined every pair of decode d1; here one confirmed failure of one of them (this router's
    own evidence agreeing) quarantines that pair and the other's pairs of d1, not d0's. Detector findings alone,
    or a failure of a pair no other router quarantined, stay below the threshold as before."""
    pairs = [(f"prefill:http://p{i}", f"decode:http://d{j}") for i in range(3) for j in range(2)]
    peer = frozenset(p for p in pairs if p[1] == "decode:http://d1")
    book = IntegrityBook(QuarantinePolicy(threshold=2))
    first = ("prefill:http://p0", "decode:http://d1")
    assert book.record_failure(first, "leak", 0.0, pairs, detector_only=True, corroborated=peer).newly == ()
    book = IntegrityBook(QuarantinePolicy(threshold=2))
    not_the_peers = ("prefill:http://p0", "decode:http://d0")
    assert book.record_failure(not_the_peers, "shadow", 0.0, pairs, corroborated=peer).newly == ()
    book = IntegrityBook(QuarantinePolicy(threshold=2))
    outcome = book.record_failure(first, "shadow mismatch", 1.0, pairs, corroborated=peer)
    assert set(outcome.newly) == peer
    assert not any(book.is_quarantined(p) for p in pairs if p not in peer)
