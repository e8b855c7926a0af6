"""The resume ledger (pure): what the client saw, the continuation request, and the new stream shaped into the old."""

from __future__ import annotations

import time
from typing import Any, cast

import orjson
import pytest

from tandem.registry import Role
from tandem_router.dispatch import Dispatch, Failure, Opened, ProxyRequest
from tandem_router.metrics import RouterMetrics
from tandem_router.openai.requests import ParsedRequest
from tandem_router.openai.schema import Route
from tandem_router.policy.selection import Policy
from tandem_router.pool import Pair, WorkerPool, WorkerSpec
from tandem_router.resume import ResumeConfig
from tandem_router.resume.openai_streams import ChatLedger
from tandem_router.server import ServerRequest
from tandem_router.stream_relay import StreamRelay
from tandem_router.transport import WorkerResponse

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


def test_the_workers_are_asked_for_usage_on_every_chunk() -> None:
    sent = ChatLedger(ParsedRequest.of(Route.CHAT, {**BODY, "stream_options": {"include_usage": False}})).upstream()
    assert sent["stream_options"] == {"include_usage": True, "continuous_usage_stats": True}
    assert "stream_options" not in BODY  # the client's request is not changed


def test_continuation_carries_the_relayed_text_and_shrinks_the_limits() -> None:
    ledger = ChatLedger(ParsedRequest.of(Route.CHAT, BODY))
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
    ledger = ChatLedger(ParsedRequest.of(Route.CHAT, {**prefixed, "continue_final_message": True}))
    ledger.feed(_chunk("a", {"role": "assistant", "content": "one"}, None, 1))
    assert ledger.continuation()["messages"][-1] == {"role": "assistant", "content": "Sure: one"}


def test_the_new_stream_looks_like_the_old_one() -> None:
    ledger = ChatLedger(ParsedRequest.of(Route.CHAT, {**BODY, "stream_options": {"include_usage": True}}))
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
    ledger = ChatLedger(ParsedRequest.of(Route.CHAT, BODY))
    ledger.feed(_chunk("a", delta, finish, tokens))
    assert not ledger.can_resume


def test_without_token_counts_there_is_no_resume() -> None:
    """A worker that does not report usage per chunk: the limits cannot be shrunk, so the break is final."""
    ledger = ChatLedger(ParsedRequest.of(Route.CHAT, BODY))
    ledger.feed(b'data: {"id":"a","choices":[{"index":0,"delta":{"content":"x"},"finish_reason":null}]}\n\n')
    assert not ledger.can_resume


def test_the_usage_chunk_is_dropped_unless_asked_for() -> None:
    ledger = ChatLedger(ParsedRequest.of(Route.CHAT, BODY))
    final = b'data: {"id":"a","created":1,"choices":[],"usage":{"prompt_tokens":6,"completion_tokens":2}}\n\n'
    assert ledger.feed(final) == b""
    assert ledger.feed(b"data: [DONE]\n\n") == b"data: [DONE]\n\n"


def test_an_event_the_ledger_does_not_change_is_relayed_as_the_worker_spelled_it() -> None:
    """The client asked for every chunk's usage: nothing is stripped, so the bytes stay the worker's own."""
    ledger = ChatLedger(
        ParsedRequest.of(
            Route.CHAT, {**BODY, "stream_options": {"include_usage": True, "continuous_usage_stats": True}}
        )
    )
    event = b'data: {"id": "a", "created": 1, "choices": [{"index": 0, "delta": {"content": "\\u00e9"}}]}\n\n'
    assert ledger.feed(event) == event


def test_the_relay_parses_each_event_once_for_ledger_texts_and_conformance(monkeypatch: pytest.MonkeyPatch) -> None:
    """Integrity on, and the client asked for every chunk's usage, whose null details OpenAI does not allow."""
    dispatch = _FakeDispatch([])
    dispatch.observer = object()  # integrity on: the relay extracts the texts
    body = {**BODY, "stream_options": {"continuous_usage_stats": True}}
    relay = StreamRelay(
        cast(Dispatch, dispatch),
        ResumeConfig(),
        ProxyRequest(ParsedRequest.of(Route.CHAT, body), "", "rid", 0.0),
        cast(ServerRequest, None),
        ChatLedger(ParsedRequest.of(Route.CHAT, body)),
    )
    loads = orjson.loads
    parsed: list[bytes] = []

    def counted_loads(data: bytes) -> Any:
        parsed.append(data)
        return loads(data)

    monkeypatch.setattr(orjson, "loads", counted_loads)
    chunks = [
        _chunk("a", {"role": "assistant", "content": "Hel", "tool_calls": None}, None, 1),
        _chunk("a", {"content": "lo"}, None, 2),
    ]
    out = relay._client_bytes(
        b"".join(c.replace(b'"total_tokens"', b'"prompt_tokens_details":null,"total_tokens"') for c in chunks)
    )
    assert len(parsed) == 2
    events = _events(out)
    assert [e["choices"][0]["delta"] for e in events] == [{"role": "assistant", "content": "Hel"}, {"content": "lo"}]
    assert [e["usage"] for e in events] == [
        {"prompt_tokens": 5, "completion_tokens": n, "total_tokens": 5 + n} for n in (1, 2)
    ]
    assert relay.texts is not None
    assert relay.texts.texts() == ["Hello"]


class _FakeDispatch:
    """What ``StreamRelay._resume`` uses of the dispatch: a real pool and metrics, continuations that fail first."""

    def __init__(self, failures: list[str], revisions: tuple[str, ...] = ("",)) -> None:
        self.pool = WorkerPool(Policy.ROUND_ROBIN)
        for revision in revisions:
            for role, n in ((Role.PREFILL, 2), (Role.DECODE, 3)):
                for i in range(n):
                    self.pool.upsert(WorkerSpec(role, f"http://{role.value}{i}{revision}", revision=revision))
        self.metrics = RouterMetrics(self.pool)
        self.observer: object | None = None
        self.failures = failures
        self.tried: list[Pair] = []

    async def open_pair(self, pair: Pair, req: object, body: dict[str, Any]) -> Any:
        self.tried.append(pair)
        lease = self.pool.lease(pair, 0.0)
        if self.failures:
            lease.release(0.0)
            return Failure(self.failures.pop(0), True)
        return Opened(lease, cast(WorkerResponse, None), b"first")


def _relay(dispatch: _FakeDispatch) -> StreamRelay:
    req = ProxyRequest(ParsedRequest.of(Route.CHAT, BODY), "", "rid", 0.0)
    relay = StreamRelay(
        cast(Dispatch, dispatch),
        ResumeConfig(),
        req,
        cast(ServerRequest, None),
        ChatLedger(ParsedRequest.of(Route.CHAT, BODY)),
    )
    assert relay.ledger is not None
    relay.ledger.feed(_chunk("a", {"role": "assistant", "content": "Hello"}, None, 1))
    return relay


async def test_a_continuation_whose_prefill_dies_moves_on_without_either_failed_worker() -> None:
    dispatch = _FakeDispatch(["prefill_unreachable"])
    broken = Pair(WorkerSpec(Role.PREFILL, "http://prefill0"), WorkerSpec(Role.DECODE, "http://decode0"))
    resumed = await _relay(dispatch)._resume(broken, time.monotonic())
    assert resumed is not None
    first, second = dispatch.tried
    assert first.decode.url != "http://decode0"
    assert second.decode.url != "http://decode0"
    assert second.prefill.url != first.prefill.url  # the prefill that died is skipped too
    samples = [s for m in dispatch.metrics.registry.collect() for s in m.samples]
    counted = {s.labels["reason"]: s.value for s in samples if s.name == "tandem_router_resumed_streams_total"}
    assert counted == {"prefill_unreachable": 1}  # the resume is counted under what broke the last pair


async def test_resume_gives_up_after_max_attempts() -> None:
    dispatch = _FakeDispatch(["decode_stream_error"] * 5)
    broken = Pair(WorkerSpec(Role.PREFILL, "http://prefill0"), WorkerSpec(Role.DECODE, "http://decode0"))
    assert await _relay(dispatch)._resume(broken, time.monotonic()) is None
    assert len(dispatch.tried) == ResumeConfig().max_attempts


async def test_resume_stays_on_the_broken_pairs_revision() -> None:
    """During a rollout the relayed tokens came from the old model: the continuation never moves to the new one."""
    dispatch = _FakeDispatch(["decode_stream_error"] * 3, revisions=("old", "new"))
    broken = Pair(
        WorkerSpec(Role.PREFILL, "http://prefill0old", revision="old"),
        WorkerSpec(Role.DECODE, "http://decode0old", revision="old"),
    )
    await _relay(dispatch)._resume(broken, time.monotonic())
    assert dispatch.tried
    assert {(p.prefill.revision, p.decode.revision) for p in dispatch.tried} == {("old", "old")}
