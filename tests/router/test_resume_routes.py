"""Which streams are resumed and which are refused (and why); completions and ``/generate`` continuations. Pure."""

from __future__ import annotations

from typing import Any

import orjson
import pytest

from tandem_router.openai.requests import ParsedRequest
from tandem_router.openai.schema import Route
from tandem_router.resume import Refusal, StreamLedger, new_ledger
from tandem_router.resume.generate import GenerateLedger
from tandem_router.resume.openai_streams import ChatLedger, CompletionLedger

CHAT = {"messages": [{"role": "user", "content": "hi"}], "stream": True}
COMPLETION = {"prompt": "Once upon a", "stream": True, "max_tokens": 10, "min_tokens": 3, "seed": 5}
GENERATE = {"text": "Once upon a", "stream": True, "sampling_params": {"max_new_tokens": 10, "sampling_seed": 5}}
TOOL = {"type": "function", "function": {"name": "f"}}


@pytest.mark.parametrize(
    ("route", "body", "code"),
    [
        (Route.CHAT, {**CHAT, "stream": False}, "not_streamed"),
        (Route.CHAT, {**CHAT, "n": 2}, "n"),
        (Route.CHAT, {**CHAT, "tools": [TOOL]}, "tools"),
        (Route.CHAT, {**CHAT, "tool_choice": "required"}, "tools"),
        (Route.COMPLETIONS, {**COMPLETION, "n": 3}, "n"),
        (Route.COMPLETIONS, {**COMPLETION, "logprobs": 2}, "logprobs"),
        (Route.COMPLETIONS, {**COMPLETION, "prompt": [1, 2, 3]}, "token_prompt"),
        (Route.COMPLETIONS, {**COMPLETION, "prompt": ["a", "b"]}, "batch"),
        (Route.GENERATE, {**GENERATE, "sampling_params": {"n": 2}}, "n"),
        (Route.GENERATE, {**GENERATE, "return_logprob": True}, "logprobs"),
        (Route.GENERATE, {**GENERATE, "text": ["a", "b"]}, "batch"),
        (Route.GENERATE, {"input_ids": [[1], [2]], "stream": True}, "batch"),
        (Route.GENERATE, {**GENERATE, "image_data": "x.png"}, "input"),
    ],
)
def test_what_is_refused_and_why(route: Route, body: dict[str, Any], code: str) -> None:
    refused = new_ledger(ParsedRequest.of(route, body))
    assert isinstance(refused, Refusal)
    assert refused.code == code
    assert refused.why


@pytest.mark.parametrize(
    ("route", "body", "kind"),
    [
        (Route.CHAT, CHAT, ChatLedger),
        (Route.CHAT, {**CHAT, "tools": [], "tool_choice": "none"}, ChatLedger),
        (Route.COMPLETIONS, COMPLETION, CompletionLedger),
        (Route.COMPLETIONS, {**COMPLETION, "prompt": ["Once"]}, CompletionLedger),
        (Route.GENERATE, GENERATE, GenerateLedger),
        (Route.GENERATE, {"input_ids": [70, 71], "stream": True}, GenerateLedger),
    ],
)
def test_what_is_resumed(route: Route, body: dict[str, Any], kind: type[StreamLedger]) -> None:
    assert isinstance(new_ledger(ParsedRequest.of(route, body)), kind)


def _sse(doc: dict[str, Any]) -> bytes:
    return b"data: " + orjson.dumps(doc) + b"\n\n"


def _events(raw: bytes) -> list[Any]:
    return [orjson.loads(e[6:]) for e in raw.split(b"\n\n") if e.startswith(b"data: {")]


def _completion(rid: str, text: str, completion: int, prompt: int = 3, finish: str | None = None) -> bytes:
    usage = {"prompt_tokens": prompt, "completion_tokens": completion, "total_tokens": prompt + completion}
    choice = {"index": 0, "text": text, "logprobs": None, "finish_reason": finish}
    return _sse({"id": rid, "created": 1 if rid == "a" else 2, "object": "text_completion", "choices": [choice],
                 "usage": usage})  # fmt: skip


def test_a_completion_continues_its_prompt_with_the_relayed_text() -> None:
    ledger = CompletionLedger(ParsedRequest.of(Route.COMPLETIONS, {**COMPLETION, "echo": True}))
    shown = _events(ledger.feed(_completion("a", "Once upon a time", 1) + _completion("a", " there", 2)))
    assert [e["choices"][0]["text"] for e in shown] == ["Once upon a time", " there"]  # the echo reaches the client
    assert ledger.text == " time there"  # ... but it is not output
    ledger.next_segment()
    body = ledger.continuation()
    assert (body["prompt"], body["echo"], body["max_tokens"], body["min_tokens"]) == (
        "Once upon a time there",
        False,
        8,
        1,
    )
    assert (body["seed"], body["stream_options"]["continuous_usage_stats"]) == (5, True)
    rest = _events(ledger.feed(_completion("b", " was", 1, prompt=5, finish="length")))
    assert (rest[0]["id"], rest[0]["created"], rest[0]["usage"]) == ("a", 1, None)
    assert ledger.sent_tokens == 3
    assert ledger.finished


def test_a_completion_without_max_tokens_has_sglangs_16() -> None:
    ledger = CompletionLedger(ParsedRequest.of(Route.COMPLETIONS, {"prompt": ["Once"], "stream": True}))
    ledger.feed(_completion("a", " upon", 1))
    body = ledger.continuation()
    assert (body["prompt"], body["max_tokens"]) == (["Once upon"], 15)


def _gen(text: str, ids: list[int], rid: str = "r1", prompt: int = 3, finish: Any = None, **extra: Any) -> bytes:
    meta = {"id": rid, "finish_reason": finish, "prompt_tokens": prompt, "completion_tokens": len(ids)}
    return _sse({"text": text, "output_ids": ids, "meta_info": meta, **extra})


def test_generate_continues_token_for_token_from_the_prompt_ids() -> None:
    ledger = GenerateLedger(ParsedRequest.of(Route.GENERATE, GENERATE))
    sent = ledger.upstream()
    assert sent["return_prompt_token_ids"] is True  # a text prompt: the worker tells its ids
    shown = _events(ledger.feed(_gen(" time", [9], prompt_token_ids=[1, 2, 3])))
    shown += _events(ledger.feed(_gen(" time there", [9, 8], prompt_token_ids=[1, 2, 3])))
    assert all("prompt_token_ids" not in e for e in shown)  # the client did not ask for them
    assert ledger.can_resume
    ledger.next_segment()
    body = ledger.continuation()
    assert "text" not in body
    assert body["input_ids"] == [1, 2, 3, 9, 8]
    assert body["sampling_params"] == {"max_new_tokens": 8, "sampling_seed": 5}
    rest = _events(ledger.feed(_gen(" was", [7], rid="r2", prompt=5) + _gen(" was", [7], "r2", 5, {"type": "length"})))
    assert [e["text"] for e in rest] == [" time there was"] * 2
    assert [e["output_ids"] for e in rest] == [[9, 8, 7]] * 2
    assert {
        (e["meta_info"]["id"], e["meta_info"]["prompt_tokens"], e["meta_info"]["completion_tokens"]) for e in rest
    } == {("r1", 3, 3)}
    assert ledger.finished
    assert not ledger.can_resume


def test_generate_with_incremental_streaming_output() -> None:
    """``--incremental-streaming-output``: each event carries only what is new, and so does the resumed stream."""
    ledger = GenerateLedger(
        ParsedRequest.of(Route.GENERATE, {"input_ids": [1, 2], "stream": True, "return_prompt_token_ids": True})
    )
    assert ledger.upstream() == ledger.body  # token ids given: nothing to ask for
    ledger.feed(_gen(" a", [9]))
    second = _events(ledger.feed(_sse({"text": " b", "output_ids": [8], "meta_info": {"completion_tokens": 2}})))
    assert second[0]["prompt_token_ids"] == [1, 2]
    assert ledger.incremental
    ledger.next_segment()
    assert ledger.continuation()["input_ids"] == [1, 2, 9, 8]
    assert ledger.continuation()["sampling_params"] == {"max_new_tokens": 126}  # SGLang's default 128, less 2
    rest = _events(ledger.feed(_sse({"text": " c", "output_ids": [7], "meta_info": {"completion_tokens": 1}})))
    assert (rest[0]["text"], rest[0]["output_ids"], rest[0]["meta_info"]["completion_tokens"]) == (" c", [7], 3)
    assert rest[0]["prompt_token_ids"] == [1, 2]  # the client asked: its own prompt's, not the continuation's
    assert ledger.text == " a b c"


def test_generate_refuses_without_prompt_ids() -> None:
    ledger = GenerateLedger(ParsedRequest.of(Route.GENERATE, GENERATE))
    ledger.feed(_gen(" time", [9]))  # a worker that ignored return_prompt_token_ids
    assert ledger.refusal is not None
    assert ledger.refusal.code == "no_prompt_ids"
