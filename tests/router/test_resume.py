"""The resume ledger (pure): what the client saw, the continuation request, and the new stream shaped into the old."""

from __future__ import annotations

from typing import Any

import orjson
import pytest

from tandem_router.resume import StreamLedger, resumable, upstream_body
from tandem_router.schema import Route

BODY: dict[str, Any] = {
    "model": "m",
    "messages": [{"role": "user", "content": "hi"}],
    "stream": True,
    "max_tokens": 10,
    "min_tokens": 2,
    "seed": 7,
    "temperature": 0,
}


def _chunk(stream_id: str, delta: dict[str, Any], finish: str | None, completion: int, prompt: int = 5) -> bytes:
    doc = {
        "id": stream_id,
        "created": 100 if stream_id == "a" else 200,
        "object": "chat.completion.chunk",
        "choices": [{"index": 0, "delta": delta, "finish_reason": finish}],
        "usage": {"prompt_tokens": prompt, "completion_tokens": completion, "total_tokens": prompt + completion},
    }
    return b"data: " + orjson.dumps(doc) + b"\n\n"


def _events(raw: bytes) -> list[Any]:
    return [orjson.loads(e[6:]) for e in raw.split(b"\n\n") if e.startswith(b"data: {")]


def test_only_single_choice_chat_streams_without_tools_are_resumable() -> None:
    assert resumable(Route.CHAT, BODY)
    assert not resumable(Route.CHAT, {**BODY, "stream": False})
    assert not resumable(Route.CHAT, {**BODY, "n": 2})
    assert not resumable(Route.CHAT, {**BODY, "tools": [{"type": "function", "function": {"name": "f"}}]})
    assert not resumable(Route.COMPLETIONS, {"prompt": "x", "stream": True})
    assert not resumable(Route.GENERATE, {"text": "x", "stream": True})


def test_the_workers_are_asked_for_usage_on_every_chunk() -> None:
    sent = upstream_body({**BODY, "stream_options": {"include_usage": False}})
    assert sent["stream_options"] == {"include_usage": True, "continuous_usage_stats": True}
    assert "stream_options" not in BODY  # the client's request is not changed


def test_continuation_carries_the_relayed_text_and_shrinks_the_limits() -> None:
    ledger = StreamLedger(BODY)
    ledger.feed(_chunk("a", {"role": "assistant", "content": "Hello"}, None, 1))
    ledger.feed(_chunk("a", {"content": " wor"}, None, 2) + _chunk("a", {"content": "ld"}, None, 3)[:20])
    assert ledger.text == "Hello wor"  # the half event is not the client's yet
    assert ledger.can_resume
    ledger.next_segment()
    body = ledger.continuation()
    assert body["messages"] == [*BODY["messages"], {"role": "assistant", "content": "Hello wor"}]
    assert body["continue_final_message"] is True
    assert (body["max_tokens"], body["min_tokens"], body["seed"], body["temperature"]) == (8, 0, 7, 0)
    assert body["stream_options"]["continuous_usage_stats"] is True


def test_a_client_prefix_is_extended_not_repeated() -> None:
    prefixed = {**BODY, "messages": [*BODY["messages"], {"role": "assistant", "content": "Sure: "}]}
    ledger = StreamLedger({**prefixed, "continue_final_message": True})
    ledger.feed(_chunk("a", {"role": "assistant", "content": "one"}, None, 1))
    assert ledger.continuation()["messages"][-1] == {"role": "assistant", "content": "Sure: one"}


def test_the_new_stream_looks_like_the_old_one() -> None:
    ledger = StreamLedger({**BODY, "stream_options": {"include_usage": True}})
    first = _events(ledger.feed(_chunk("a", {"role": "assistant", "content": "Hello"}, None, 1)))
    assert first[0]["usage"] is None  # continuous usage only when the client asked for it
    ledger.next_segment()
    # The continuation's prompt is 5 + 1 tokens; its first chunk repeats the role.
    opening = _events(ledger.feed(_chunk("b", {"role": "assistant", "content": ""}, None, 0, prompt=6)))
    assert opening == []
    rest = _events(
        ledger.feed(_chunk("b", {"content": " world"}, None, 1, prompt=6))
        + ledger.feed(_chunk("b", {"content": ""}, "stop", 2, prompt=6))
    )
    final = b'data: {"id":"b","created":200,"choices":[],"usage":{"prompt_tokens":6,"completion_tokens":2}}\n\n'
    usage = _events(ledger.feed(final))
    assert [(e["id"], e["created"]) for e in rest + usage] == [("a", 100)] * 3
    assert "role" not in rest[0]["choices"][0]["delta"]
    assert rest[1]["choices"][0]["finish_reason"] == "stop"
    # Usage over the whole answer: the first prompt, every completion token.
    assert usage[0]["usage"] == {"prompt_tokens": 5, "completion_tokens": 3, "total_tokens": 8}
    assert ledger.text == "Hello world"
    assert ledger.finished
    assert not ledger.can_resume


@pytest.mark.parametrize(
    ("delta", "finish", "tokens"),
    [({"reasoning_content": "hmm"}, None, 1), ({"content": "x"}, "length", 1), ({"content": "x"}, None, 10)],
    ids=["reasoning-sent", "finished", "no-tokens-left"],
)
def test_what_cannot_be_resumed(delta: dict[str, Any], finish: str | None, tokens: int) -> None:
    ledger = StreamLedger(BODY)
    ledger.feed(_chunk("a", delta, finish, tokens))
    assert not ledger.can_resume


def test_without_token_counts_there_is_no_resume() -> None:
    """A worker that does not report usage per chunk: the limits cannot be shrunk, so the break is final."""
    ledger = StreamLedger(BODY)
    ledger.feed(b'data: {"id":"a","choices":[{"index":0,"delta":{"content":"x"},"finish_reason":null}]}\n\n')
    assert not ledger.can_resume


def test_the_usage_chunk_is_dropped_unless_asked_for() -> None:
    ledger = StreamLedger(BODY)
    final = b'data: {"id":"a","created":1,"choices":[],"usage":{"prompt_tokens":6,"completion_tokens":2}}\n\n'
    assert ledger.feed(final) == b""
    assert ledger.feed(b"data: [DONE]\n\n") == b"data: [DONE]\n\n"
