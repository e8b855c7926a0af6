"""Telling GPU numerics from corruption: ``integrity.divergence.compare``, the response parsers and the canary
consensus over numerically different answers (pure, no I/O)."""

from __future__ import annotations

from typing import Any

import orjson
import pytest

from tandem_router.integrity.consensus import consensus, judge
from tandem_router.integrity.divergence import (
    NEAR_TIE_NATS,
    Answer,
    Kind,
    Token,
    body_answers,
    compare,
    doc_answers,
    with_logprobs,
)

Step = tuple[str, float, list[tuple[str, float]]]  # chosen text, its logprob, the top alternatives


def sure(text: str) -> Step:
    """A confident token: the runner-up is 4 nats behind."""
    return (text, -0.02, [(text, -0.02), (" zzz", -4.0)])


def tied(chosen: str, runner_up: str, margin: float = 0.1) -> Step:
    return (chosen, -0.65, [(chosen, -0.65), (runner_up, -0.65 - margin)])


def answer(steps: list[Step], text: str | None = None) -> Answer:
    tokens = tuple(Token(c, lp, top=tuple(Token(t, v) for t, v in top)) for c, lp, top in steps)
    return Answer("".join(c for c, _, _ in steps) if text is None else text, tokens)


def text_of(steps: list[Step]) -> Answer:
    return Answer("".join(c for c, _, _ in steps))


PREFIX = [sure("The"), sure(" sky"), sure(" looks"), sure(" very")]
# The reference and a clean pair that flipped the near-tied " blue" / " clear" and went on differently from there.
REF = [*PREFIX, tied(" blue", " clear"), sure(" during"), sure(" the"), sure(" day"), sure(".")]
FLIP = [*PREFIX, tied(" clear", " blue"), sure(" and"), sure(" bright"), sure(" today"), sure(".")]


def test_equal_texts_are_the_same_with_or_without_logprobs() -> None:
    assert compare(answer(REF), answer(REF)).kind is Kind.SAME
    assert compare(text_of(REF), answer(REF)).kind is Kind.SAME
    assert compare(text_of(REF), text_of(REF)).kind is Kind.SAME


@pytest.mark.parametrize(
    ("a", "b"),
    [
        (answer(REF), answer(FLIP)),  # both sides have logprobs: each is the other's runner-up
        (text_of(REF), answer(FLIP)),  # only the re-run has logprobs (the client's text)
        (answer(REF), text_of(FLIP)),
    ],
)
def test_a_near_tie_flip_in_the_middle_is_numerical(a: Answer, b: Answer) -> None:
    verdict = compare(a, b)
    assert verdict.kind is Kind.NUMERICAL, verdict
    assert verdict.agrees
    assert (verdict.char, verdict.token) == (len("The sky looks very "), 4)
    assert compare(b, a).kind is Kind.NUMERICAL  # symmetric


def test_without_logprobs_a_difference_is_always_different() -> None:
    verdict = compare(text_of(REF), text_of(FLIP))
    assert verdict.kind is Kind.DIFFERENT
    assert verdict.char == len("The sky looks very ")


def test_a_confident_flip_is_different() -> None:
    confident = [*PREFIX, sure(" blue"), sure(" during"), sure(" the"), sure(" day")]
    other = [*PREFIX, sure(" clear"), sure(" and"), sure(" bright")]
    assert compare(answer(confident), text_of(other)).kind is Kind.DIFFERENT
    assert compare(text_of(confident), answer(other)).kind is Kind.DIFFERENT
    assert compare(answer(confident), answer(other)).kind is Kind.DIFFERENT


@pytest.mark.parametrize(("margin", "kind"), [(0.45, Kind.NUMERICAL), (0.55, Kind.DIFFERENT), (3.0, Kind.DIFFERENT)])
def test_the_margin_decides(margin: float, kind: Kind) -> None:
    ref = [*PREFIX, tied(" blue", " clear", margin), sure(" day")]
    assert compare(answer(ref), text_of(FLIP), NEAR_TIE_NATS).kind is kind
    assert compare(answer(ref), text_of(FLIP), near_tie_nats=margin + 1e-9).kind is Kind.NUMERICAL


def test_with_logprobs_on_both_sides_both_must_say_near_tie() -> None:
    # FLIP's side saw " blue" far behind: not a flip by numerics, whatever the other side says.
    lopsided = [*PREFIX, (" clear", -0.01, [(" clear", -0.01), (" blue", -3.0)]), sure(" and"), sure(" bright")]
    assert compare(answer(REF), text_of(lopsided)).kind is Kind.NUMERICAL  # REF's side alone would allow it
    assert compare(answer(REF), answer(lopsided)).kind is Kind.DIFFERENT


def test_the_other_token_must_be_the_runner_up() -> None:
    third = [*PREFIX, (" blue", -0.5, [(" blue", -0.5), (" pale", -0.6), (" clear", -0.7)]), sure(" day")]
    verdict = compare(answer(third), text_of(FLIP))
    assert verdict.kind is Kind.DIFFERENT  # " clear" is third, though within the margin


@pytest.mark.parametrize(
    "other",
    [
        "The sky looks very quarterly report of the northern mining company",  # another request's words
        "The sky looks very \ufffd\ufffd\x00\x07 <|im_start|> ]]]]",  # garbage
        "The sky looks veryclear and bright",  # the runner-up without its leading space (another token)
        "Paris is the capital of France.",  # different from the first token
    ],
)
def test_foreign_words_and_garbage_are_different(other: str) -> None:
    assert compare(answer(REF), Answer(other)).kind is Kind.DIFFERENT
    assert compare(Answer(other), answer(REF)).kind is Kind.DIFFERENT


def test_garbage_that_begins_with_the_runner_up_on_the_garbling_side_is_different() -> None:
    # The garbling pair's own logprobs (corrupted distribution) do not hold the reference's token as a near-tie.
    garbled = [*PREFIX, (" clear", -0.3, [(" clear", -0.3), (" mining", -1.0)]), sure(" quarterly"), sure(" report")]
    assert compare(answer(REF), answer(garbled)).kind is Kind.DIFFERENT


def test_early_stop_is_numerical_only_where_the_top_two_hold_an_end() -> None:
    ends = [sure("Done"), (".", -0.6, [(".", -0.6), ("", -0.7)]), sure(" Then"), sure(" more")]
    stops = [sure("Done"), ("", -0.6, [("", -0.6), (".", -0.7)])]  # EOS (the simulator renders it "")
    assert compare(answer(ends), Answer("Done")).kind is Kind.NUMERICAL
    assert compare(answer(ends), answer(stops)).kind is Kind.NUMERICAL
    assert compare(Answer("Done. Then more"), answer(stops)).kind is Kind.NUMERICAL
    no_end = [sure("Done"), sure("."), sure(" Then"), sure(" more")]
    assert compare(answer(no_end), Answer("Done")).kind is Kind.DIFFERENT
    assert compare(answer(no_end), answer(stops)).kind is Kind.DIFFERENT
    marker = [sure("Done"), (".", -0.6, [(".", -0.6), ("<|im_end|>", -0.7)]), sure(" Then")]
    assert compare(answer(marker), Answer("Done")).kind is Kind.NUMERICAL  # an end marker's rendering


def test_one_answer_a_prefix_of_the_other() -> None:
    # Both stop at max_new_tokens; the last token flipped between a short and a long one.
    short = [*PREFIX, tied(" blue", " bluest")]
    long = [*PREFIX, tied(" bluest", " blue")]
    assert compare(answer(short), answer(long)).kind is Kind.NUMERICAL
    assert compare(answer(short), text_of(long)).kind is Kind.NUMERICAL
    assert compare(text_of(short), answer(long)).kind is Kind.NUMERICAL
    # Cut short without an end in the top two (e.g. a dropped tail): different.
    assert compare(answer(REF), Answer("The sky looks very blue")).kind is Kind.DIFFERENT


def test_bpe_tokens_whose_flip_shares_a_prefix() -> None:
    # " the" / " they": the texts part after " the", inside the flipped token; the token that holds it is found.
    a = [sure("I"), sure(" saw"), tied(" the", " they"), sure("ory"), sure(" again")]
    b = [sure("I"), sure(" saw"), tied(" they", " the"), sure(" went"), sure(" home")]
    for x, y in ((answer(a), text_of(b)), (text_of(a), answer(b)), (answer(a), answer(b))):
        verdict = compare(x, y)
        assert (verdict.kind, verdict.token) == (Kind.NUMERICAL, 2), verdict
        assert verdict.char == len("I saw the")


def test_tokenisations_that_agree_in_text_then_flip() -> None:
    # "hel"+"lo" on one side, "hello" on the other (a near-tie of tokenisations), then different words.
    a = [sure("Say"), tied(" hel", " hello"), sure("lo"), sure(" world")]
    b = [sure("Say"), tied(" hello", " hel"), sure(" there")]
    assert compare(answer(a), answer(b)).kind is Kind.NUMERICAL  # the first token that differs is a near-tie
    # With one side's logprobs only, the flip must hold the first differing character.
    assert compare(answer(a), text_of(b)).kind is Kind.DIFFERENT
    c = [sure("Say"), sure(" hel"), sure("lo"), tied(" world", " there")]
    assert compare(answer(c), text_of(b)).kind is Kind.NUMERICAL


def test_texts_that_differ_where_the_tokens_agree_are_different() -> None:
    assert compare(answer(REF), answer(REF, text="The sky looks very blue during the night.")).kind is Kind.DIFFERENT


def test_multibyte_characters() -> None:
    # A CJK token flipped by a near-tie: the characters share their first two UTF-8 bytes (E4 B8 AD / E4 B8 AB).
    a = [sure("答"), sure("案"), tied("中", "丫"), sure("文")]
    b = [sure("答"), sure("案"), tied("丫", "中"), sure("头")]
    for x, y in ((answer(a), text_of(b)), (text_of(a), answer(b)), (answer(a), answer(b))):
        verdict = compare(x, y)
        assert (verdict.kind, verdict.char, verdict.token) == (Kind.NUMERICAL, 2, 2), verdict
    # A character split over two byte-level tokens renders each as U+FFFD (SGLang's return_text_in_logprobs):
    # the tokens after it still line up with the text.
    split = [sure("x"), sure("\ufffd"), sure("\ufffd"), tied(" y", " z"), sure(" w")]
    assert compare(answer(split, text="x𠮷 y w"), Answer("x𠮷 z q")).kind is Kind.NUMERICAL
    assert compare(answer(split, text="x𠮷 y w"), Answer("x𠮷 q z")).kind is Kind.DIFFERENT
    assert compare(answer(split, text="x𠮷 y w"), Answer("x𠮸 y w")).kind is Kind.DIFFERENT


def test_chat_bytes_place_partial_characters() -> None:
    # OpenAI chat's ``bytes`` say exactly which bytes a partial token holds.
    doc = _chat_doc(
        "x😀 y w",
        [
            ("x", -0.01, [0x78], []),
            ("\ufffd", -0.01, [0xF0, 0x9F], []),
            ("\ufffd", -0.01, [0x98, 0x80], []),
            (" y", -0.6, [0x20, 0x79], [(" y", -0.6), (" z", -0.7)]),
            (" w", -0.01, [0x20, 0x77], []),
        ],
    )
    [parsed] = body_answers("/v1/chat/completions", doc)
    assert compare(parsed, Answer("x😀 z")).kind is Kind.NUMERICAL
    assert compare(parsed, Answer("x😁 y w")).kind is Kind.DIFFERENT


# -- parsers ---------------------------------------------------------------------------------------------------------


VOCABULARY: dict[str, int] = {}  # token text -> id, shared by every answer (one tokenizer)


def generate_doc(text: str, steps: list[Step]) -> dict[str, Any]:
    """An SGLang ``/generate`` body with ``return_logprob``, ``top_logprobs_num`` and ``return_text_in_logprobs``."""
    ids = VOCABULARY
    return {
        "text": text,
        "meta_info": {
            "output_token_logprobs": [[lp, ids.setdefault(c, len(ids)), c] for c, lp, _ in steps],
            "output_top_logprobs": [[[v, ids.setdefault(t, len(ids)), t] for t, v in top] for _, _, top in steps],
        },
    }


def _chat_doc(text: str, tokens: list[tuple[str, float, list[int], list[tuple[str, float]]]]) -> bytes:
    content = [
        {
            "token": t,
            "logprob": lp,
            "bytes": raw,
            "top_logprobs": [{"token": a, "logprob": v, "bytes": list(a.encode())} for a, v in top],
        }
        for t, lp, raw, top in tokens
    ]
    choice = {"index": 0, "message": {"role": "assistant", "content": text}, "logprobs": {"content": content}}
    return orjson.dumps({"choices": [choice]})


def test_generate_response_with_logprobs() -> None:
    body = orjson.dumps(generate_doc("".join(c for c, _, _ in FLIP), FLIP))
    [parsed] = body_answers("/generate", body)
    assert parsed.text == "The sky looks very clear and bright today."
    assert parsed.tokens is not None
    assert len(parsed.tokens) == len(FLIP)
    assert parsed.tokens[4].text == " clear"
    assert parsed.tokens[4].token_id == parsed.tokens[4].top[0].token_id
    assert [t.text for t in parsed.tokens[4].top] == [" clear", " blue"]
    assert compare(text_of(REF), parsed).kind is Kind.NUMERICAL
    batch = body_answers("/generate", orjson.dumps([generate_doc("a", [sure("a")]), {"text": "b"}]))
    assert [(a.text, a.tokens is None) for a in batch] == [("a", False), ("b", True)]


def test_generate_tokens_with_ids_compare_by_id() -> None:
    # Two partial characters render the same (U+FFFD) but are different tokens: the ids tell them apart.
    doc_a = {"text": "x", "meta_info": {"output_token_logprobs": [[-0.1, 7, "\ufffd"]], "output_top_logprobs": [[]]}}
    doc_b = {"text": "y", "meta_info": {"output_token_logprobs": [[-0.1, 8, "\ufffd"]], "output_top_logprobs": [[]]}}
    [a] = body_answers("/generate", orjson.dumps(doc_a))
    [b] = body_answers("/generate", orjson.dumps(doc_b))
    assert compare(a, b).kind is Kind.DIFFERENT


def test_completions_response_with_logprobs() -> None:
    steps = FLIP
    logprobs = {
        "tokens": [c for c, _, _ in steps],
        "token_logprobs": [lp for _, lp, _ in steps],
        "top_logprobs": [dict(top) for _, _, top in steps],
        "text_offset": [-1] * len(steps),
    }
    body = orjson.dumps({"choices": [{"index": 0, "text": "".join(c for c, _, _ in steps), "logprobs": logprobs}]})
    [parsed] = body_answers("/v1/completions", body)
    assert compare(text_of(REF), parsed).kind is Kind.NUMERICAL
    # SGLang renders a partial character one latin-1 char per byte on this route.
    frag = {
        "tokens": ["x", "\xf0\x9f", "\x98\x80", " y", " w"],
        "token_logprobs": [None, -0.01, -0.01, -0.6, -0.01],  # (the echo's first token has no logprob)
        "top_logprobs": [None, {}, {}, {" y": -0.6, " z": -0.7}, None],
    }
    [parsed] = body_answers("/v1/completions", orjson.dumps({"choices": [{"text": "x😀 y w", "logprobs": frag}]}))
    assert compare(parsed, Answer("x😀 z")).kind is Kind.NUMERICAL


def test_responses_without_logprobs_or_json() -> None:
    assert body_answers("/generate", b"not json") == []
    assert body_answers("/v1/chat/completions", orjson.dumps({"choices": [{"message": {"content": "hi"}}]})) == [
        Answer("hi")
    ]
    reasoning = {"message": {"reasoning_content": "think ", "content": "hi"}, "logprobs": None}
    assert body_answers("/v1/chat/completions", orjson.dumps({"choices": [reasoning]})) == [Answer("think hi")]


@pytest.mark.parametrize(
    ("route", "body", "asked"),
    [
        (
            "/generate",
            {"text": "x", "sampling_params": {"temperature": 0}, "return_logprob": False, "top_logprobs_num": 5},
            {"return_logprob": True, "top_logprobs_num": 2, "return_text_in_logprobs": True},
        ),
        ("/v1/chat/completions", {"messages": [], "logprobs": False}, {"logprobs": True, "top_logprobs": 2}),
        ("/v1/chat/completions", {"messages": [], "logprobs": True, "top_logprobs": 20}, {"top_logprobs": 2}),
        ("/v1/completions", {"prompt": "x", "logprobs": 5, "echo": True}, {"logprobs": 2, "echo": True}),
    ],
)
def test_with_logprobs_asks_on_a_copy(route: str, body: dict[str, Any], asked: dict[str, Any]) -> None:
    before = orjson.dumps(body)
    copy = with_logprobs(route, body)
    assert orjson.dumps(body) == before  # the client's body is untouched
    assert copy.items() >= asked.items()
    assert {k: v for k, v in copy.items() if k not in asked} == {k: v for k, v in body.items() if k not in asked}


# -- consensus -------------------------------------------------------------------------------------------------------


def test_consensus_counts_numerical_answers_with_the_majority() -> None:
    garbled = Answer("The sky looks very quarterly report northern mining", None)
    answers = {("p", "d0"): answer(REF), ("p", "d1"): answer(FLIP), ("p", "d2"): garbled}
    verdict = judge(answers)
    assert verdict.reference is not None
    assert verdict.failed == {("p", "d2")}
    assert verdict.passed == {("p", "d0"), ("p", "d1")}
    assert len(verdict.numerical) == 1  # whichever answer is not the reference
    assert verdict.verdicts[("p", "d2")].kind is Kind.DIFFERENT


def test_consensus_prefers_the_answer_most_agree_with() -> None:
    # Numerical agreement is not transitive: Y is a near-tie flip of X, Z one of Y but not of X (Z's side is sure
    # of " clear"). X, X, Y, Z and garbage: 3 of 5 agree with X, 4 with Y. Y is the reference, and only the
    # garbage fails.
    x = REF
    y = [*PREFIX, tied(" clear", " blue"), sure(" and"), tied(" bright", " warm"), sure(".")]
    z = [*PREFIX, sure(" clear"), sure(" and"), tied(" warm", " bright"), sure(" today")]
    assert compare(answer(x), answer(z)).kind is Kind.DIFFERENT
    answers = {("p", f"d{i}"): a for i, a in enumerate([answer(x), answer(x), answer(y), answer(z)])}
    answers["p", "d4"] = Answer("garbage words here")
    verdict = judge(answers)
    assert verdict.reference is not None
    assert verdict.reference.text == text_of(y).text
    assert verdict.failed == {("p", "d4")}
    assert verdict.numerical == {("p", "d0"), ("p", "d1"), ("p", "d3")}
    # Equally supported texts: the most frequent wins.
    assert consensus([answer(FLIP), answer(REF), answer(REF)]) == answer(REF)


def test_numerics_cannot_make_a_majority_out_of_different_answers() -> None:
    other = Answer("Paris is the capital of France.")
    assert consensus([answer(REF), other, Answer("Something else entirely.")]) is None
    assert judge({("p", "d0"): answer(REF), ("p", "d1"): other}).reference is None  # two camps: nobody blamed


def test_a_stored_reference_judges_numerical_answers_as_passing() -> None:
    verdict = judge({("p", "d0"): answer(FLIP), ("p", "d1"): Answer("nonsense")}, reference=answer(REF))
    assert verdict.numerical == {("p", "d0")}
    assert verdict.failed == {("p", "d1")}


@pytest.mark.parametrize(
    ("latency", "worker_s"), [(0.4, 0.4), (2, 2.0), (-1.0, None), ("0.4", None), (True, None), (float("inf"), None)]
)
def test_generate_answers_carry_the_workers_own_time_if_a_duration(latency: Any, worker_s: float | None) -> None:
    doc = {"text": "x", "meta_info": {"e2e_latency": latency}}
    assert doc_answers("/generate", doc)[0].worker_s == worker_s
    assert doc_answers("/generate", [doc, {"text": "y"}])[1].worker_s is None


def test_openai_answers_carry_no_worker_time() -> None:
    assert body_answers("/v1/chat/completions", _chat_doc("hi", []))[0].worker_s is None
