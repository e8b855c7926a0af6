"""The router against real loopback instant PD workers: PD protocol, streaming, retries, errors, limits."""

from __future__ import annotations

import asyncio
from typing import Any

import orjson
import pytest

import tandem
from tandem.registry import Role
from tandem_dev.procs import free_port
from tandem_router.policy.selection import Policy
from tandem_router.pool import WorkerSpec
from tests.router.helpers import stack

CHAT = {"model": "instant-model", "messages": [{"role": "user", "content": "hello"}]}


def _events(raw: bytes) -> list[bytes]:
    return [e.removeprefix(b"data: ") for e in raw.split(b"\n\n") if e]


async def test_pd_fields_same_room_on_both_sides_and_stream_relayed() -> None:
    async with stack(1, 1) as s:
        status, raw = await s.post("/v1/chat/completions", {**CHAT, "stream": True}, {"X-Request-Id": "rid-1"})
        assert status == 200
        events = _events(raw)
        assert len(events) == 17
        assert events[-1] == b"[DONE]"
        assert orjson.loads(events[0])["choices"][0]["delta"]["content"] == "tok0 "
        (p,) = await s.received(s.prefills[0])
        (d,) = await s.received(s.decodes[0])
        assert p["body"] == d["body"]
        assert p["body"]["bootstrap_host"] == "127.0.0.1"
        assert p["body"]["bootstrap_port"] == 8998
        assert 0 <= p["body"]["bootstrap_room"] <= 2**63 - 1
        assert p["request_id"] == d["request_id"] == "rid-1"
        assert p["body"]["messages"] == CHAT["messages"]


async def test_fields_pass_through_untouched_and_rooms_are_fresh() -> None:
    tools = [{"type": "function", "function": {"name": "f", "parameters": {"type": "object"}}}]
    body = {**CHAT, "tools": tools, "tool_choice": "auto", "reasoning_effort": "high", "separate_reasoning": True}
    async with stack(1, 1) as s:
        for _ in range(3):
            status, raw = await s.post("/v1/chat/completions", body)
            assert status == 200
            assert orjson.loads(raw)["choices"][0]["message"]["content"].startswith("tok0")
        got = await s.received(s.decodes[0])
        for key in ("tools", "tool_choice", "reasoning_effort", "separate_reasoning"):
            assert got[0]["body"][key] == body[key]
        assert len({g["body"]["bootstrap_room"] for g in got}) == 3


@pytest.mark.parametrize(
    ("path", "body", "items"),
    [
        ("/generate", {"text": ["a", "b", "c"], "sampling_params": {"max_new_tokens": 4}}, 3),
        ("/generate", {"input_ids": [[1, 2], [3]]}, 2),
        ("/v1/completions", {"model": "instant-model", "prompt": ["x", "y"], "n": 2}, 4),
        ("/v1/chat/completions", {**CHAT, "n": 3}, 3),
    ],
)
async def test_batches_and_n_get_one_room_per_item(path: str, body: dict[str, Any], items: int) -> None:
    async with stack(1, 1) as s:
        status, _ = await s.post(path, body)
        assert status == 200
        (d,) = await s.received(s.decodes[0])
        rooms = d["body"]["bootstrap_room"]
        assert isinstance(rooms, list)
        assert len(set(rooms)) == items
        assert d["body"]["bootstrap_host"] == ["127.0.0.1"] * items


async def test_retryable_decode_status_moves_to_another_pair_with_a_new_room() -> None:
    async with stack(2, 2) as s:
        await s.faults(s.decodes[0], status=503, count=1)
        await s.faults(s.decodes[1], status=503, count=1)
        status, raw = await s.post("/v1/completions", {"model": "instant-model", "prompt": "p", "stream": True})
        assert status == 200, raw
        assert _events(raw)[-1] == b"[DONE]"
        bodies = [r["body"] for d in s.decodes for r in await s.received(d)]
        assert len(bodies) == 3
        assert len({b["bootstrap_room"] for b in bodies}) == 3
        pairs = {(b["bootstrap_port"], b["bootstrap_room"]) for b in bodies}
        assert len(pairs) == 3
        metrics = await (await s.http.get(f"{s.router.url}/metrics")).text()
        assert 'tandem_router_retries_total{reason="decode_http_503",route="/v1/completions"} 2.0' in metrics


async def test_prefill_failure_before_first_byte_is_retried() -> None:
    async with stack(2, 1) as s:
        await s.faults(s.prefills[0], status=500, count=5)
        await s.faults(s.decodes[0], delay_s=0.3)  # like a real decode, it answers only after the KV arrived
        for _ in range(4):
            status, _ = await s.post("/generate", {"text": "hi"})
            assert status == 200
        assert len(await s.received(s.prefills[0])) >= 1
        assert len(await s.received(s.prefills[1])) == 4


async def test_decode_error_event_before_first_token_is_retried() -> None:
    async with stack(1, 2) as s:
        await s.faults(s.decodes[0], stream_error=True)
        await s.faults(s.decodes[1], stream_error=True)
        status, raw = await s.post("/generate", {"text": "hi", "stream": True})
        assert status == 200
        assert b"error" not in raw
        assert _events(raw)[-1] == b"[DONE]"


async def test_stream_broken_after_first_byte_ends_with_openai_error_event() -> None:
    async with stack(1, 1) as s:
        await s.faults(s.decodes[0], break_after=3)
        status, raw = await s.post("/v1/chat/completions", {**CHAT, "stream": True})
        assert status == 200
        events = _events(raw)
        assert len(events) == 4
        err = orjson.loads(events[-1])["error"]
        assert err["type"] == "server_error"
        assert "decode worker stream failed" in err["message"]


async def test_a_broken_stream_resumes_on_a_fresh_decode_at_most_max_attempts_times() -> None:
    """Every decode breaks its stream after 3 chunks: the first break resumes on the second decode, the second on
    the third (each a continuation of what the client had), the third break is past ``--resume-max-attempts``
    (default 2) and ends the stream with the OpenAI error event, as a stream that cannot be resumed does."""
    async with stack(1, 3) as s:
        for d in s.decodes:
            await s.faults(d, break_after=3)
        status, raw = await s.post("/v1/chat/completions", {**CHAT, "stream": True, "max_tokens": 40})
        assert status == 200
        events = _events(raw)
        message = orjson.loads(events[-1])["error"]["message"]
        assert "decode worker stream failed" in message
        assert "not resumed: 2 fresh pair(s) tried" in message
        chunks = [orjson.loads(e) for e in events[:-1]]
        assert len({c["id"] for c in chunks}) == 1
        assert len(chunks) == 9  # three from each decode, nothing repeated
        # In the order they were sent: each continuation carries more relayed text than the one before.
        bodies = sorted(
            [r["body"] for d in s.decodes for r in await s.received(d)],
            key=lambda b: (len(b["messages"]), len(str(b["messages"][-1]["content"]))),
        )
        assert bodies[0]["messages"] == CHAT["messages"]
        relayed = "".join(c["choices"][0]["delta"]["content"] for c in chunks[:3])
        assert bodies[1]["messages"][-1] == {"role": "assistant", "content": relayed}
        assert bodies[1]["continue_final_message"] is True
        assert bodies[1]["max_tokens"] == 40 - 3
        metrics = await (await s.http.get(f"{s.router.url}/metrics")).text()
        resumed = 'tandem_router_resumed_streams_total{reason="decode_stream_broken",route="/v1/chat/completions"} 2.0'
        assert resumed in metrics
        assert 'tandem_router_resume_refused_total{reason="attempts",route="/v1/chat/completions"} 1.0' in metrics
        assert "tandem_router_resume_gap_seconds_count 2.0" in metrics
        assert 'tandem_router_stream_errors_total{route="/v1/chat/completions"} 1.0' in metrics


SGLANG_400 = {"object": "error", "message": "top_p must be in (0, 1], got 0.0.", "type": "BadRequestError",
              "param": None, "code": 400}  # fmt: skip


def _openai_error(raw: bytes) -> dict[str, Any]:
    doc = orjson.loads(raw)
    assert set(doc) == {"error"}, doc
    assert set(doc["error"]) == {"message", "type", "param", "code"}, doc
    assert doc["error"]["code"] is None or isinstance(doc["error"]["code"], str), doc
    error: dict[str, Any] = doc["error"]
    return error


@pytest.mark.parametrize("side", ["prefill", "decode"])
async def test_worker_4xx_is_an_openai_error_never_retried_nor_counted(side: str) -> None:
    """Whichever side refuses first: same status, the worker's message, the parameter it names, no retry, no
    pair failure; the other side's request is cancelled (issue 19 item 3)."""
    async with stack(2, 2) as s:
        for p in s.prefills:
            await s.faults(p, status=400, count=10, body=SGLANG_400, delay_s=0.0 if side == "prefill" else 1.0)
        for d in s.decodes:
            await s.faults(d, status=400, count=10, body=SGLANG_400, delay_s=1.0 if side == "prefill" else 0.0)
        for stream in (False, True, False, True, False):
            status, raw = await s.post("/v1/completions", {"model": "instant-model", "prompt": "x", "top_p": 0,
                                                           "stream": stream})  # fmt: skip
            assert status == 400, raw
            error = _openai_error(raw)
            assert error == {"message": SGLANG_400["message"], "type": "invalid_request_error", "param": "top_p",
                             "code": None}  # fmt: skip
        prefills = [len(await s.received(p)) for p in s.prefills]
        decodes = [len(await s.received(d)) for d in s.decodes]
        assert sum(prefills) == sum(decodes) == 5  # never retried
        metrics = await (await s.http.get(f"{s.router.url}/metrics")).text()
        assert "tandem_router_pair_failures_total{" not in metrics
        assert "tandem_router_retries_total{" not in metrics
        assert 'tandem_router_requests_total{route="/v1/completions",status="400"} 5.0' in metrics
        assert all(w.breaker.state.value == "closed" for w in s.state.pool.workers.values())


async def test_stream_error_event_with_4xx_code_is_an_http_4xx() -> None:
    async with stack(1, 2) as s:
        await s.faults(s.decodes[0], stream_error=True, stream_error_code=400)
        await s.faults(s.decodes[1], stream_error=True, stream_error_code=400)
        status, raw = await s.post("/generate", {"text": "hi", "stream": True})
        assert status == 400, raw
        assert _openai_error(raw)["message"] == "injected KV transfer failure"
        assert len(await s.received(s.decodes[0])) + len(await s.received(s.decodes[1])) == 1


async def test_validation_error_names_the_parameter_from_pydantic_loc() -> None:
    message = ("1 validation error: {'type': 'int_parsing', 'loc': ('body', 'top_logprobs'), 'msg': 'Input should "
               "be a valid integer'}")  # fmt: skip
    async with stack(1, 1) as s:
        await s.faults(s.decodes[0], status=400, count=1, body={"object": "error", "message": message, "code": 400})
        status, raw = await s.post("/v1/chat/completions", CHAT)
        assert status == 400
        assert _openai_error(raw)["param"] == "top_logprobs"


async def test_non_retryable_worker_error_is_relayed() -> None:
    async with stack(1, 1) as s:
        await s.faults(s.decodes[0], status=404, count=1)
        status, raw = await s.post("/generate", {"text": "hi"})
        assert status == 404
        error = _openai_error(raw)
        assert error["message"] == "injected failure 404"
        assert error["type"] == "not_found_error"
        assert len(await s.received(s.decodes[0])) == 1


async def test_never_decode_alone_when_no_prefill_is_reachable() -> None:
    dead = f"http://127.0.0.1:{free_port()}"
    async with stack(0, 1, dead_prefills=[dead]) as s:
        status, raw = await s.post("/v1/chat/completions", CHAT)
        assert status == 503
        assert orjson.loads(raw)["error"]["type"] == "service_unavailable"
        assert await s.received(s.decodes[0]) == []
        ready = await s.http.get(f"{s.router.url}/readiness")
        assert ready.status == 503


async def test_unreachable_prefill_is_retried_on_a_live_one_and_opened() -> None:
    dead = f"http://127.0.0.1:{free_port()}"
    async with stack(1, 1, dead_prefills=[dead]) as s:
        dead_state = s.state.pool.workers[f"prefill:{dead}"]
        assert dead_state.breaker.state.value == "open"  # the startup probe found nobody listening
        dead_state.breaker = type(dead_state.breaker)()  # pretend the probe has not run: requests must cope
        for _ in range(4):
            status, _ = await s.post("/v1/chat/completions", CHAT)
            assert status == 200
        assert dead_state.breaker.state.value == "open"
        assert len(await s.received(s.decodes[0])) == 4  # round robin tried the dead one once, then retried


@pytest.mark.parametrize(
    ("raw", "status", "needle"),
    [
        (b"{not json", 400, b"not valid JSON"),
        (b"[1, 2]", 400, b"must be a JSON object"),
        (orjson.dumps({"model": "instant-model", "messages": []}), 400, b"messages"),
        (orjson.dumps({"model": "instant-model", "messages": "hi"}), 400, b"messages"),
        (orjson.dumps({"model": 5, "messages": [{"role": "user", "content": "x"}]}), 400, b"model"),
        (orjson.dumps({**CHAT, "stream": "yes"}), 400, b"stream"),
        (orjson.dumps({**CHAT, "n": 0}), 400, b"n"),
        (orjson.dumps({**CHAT, "model": "nope"}), 404, b"model_not_found"),
    ],
)
async def test_bad_input_is_rejected_and_not_forwarded(raw: bytes, status: int, needle: bytes) -> None:
    async with stack(1, 1) as s:
        resp = await s.http.post(f"{s.router.url}/v1/chat/completions", data=raw)
        body = await resp.read()
        assert resp.status == status, body
        err = orjson.loads(body)["error"]
        assert needle in body
        assert err["message"]
        assert err["type"]
        assert await s.received(s.decodes[0]) == []
        assert await s.received(s.prefills[0]) == []


async def test_oversized_body_is_413() -> None:
    async with stack(1, 1, max_body_bytes=4096) as s:
        status, raw = await s.post(
            "/v1/chat/completions", {**CHAT, "messages": [{"role": "user", "content": "x" * 9000}]}
        )
        assert status == 413
        assert orjson.loads(raw)["error"]["type"] == "invalid_request_error"
        assert await s.received(s.decodes[0]) == []


async def test_api_keys() -> None:
    async with stack(1, 1, api_keys=["k1"]) as s:
        status, raw = await s.post("/v1/chat/completions", CHAT)
        assert status == 401
        assert orjson.loads(raw)["error"]["code"] == "invalid_api_key"
        status, _ = await s.post("/v1/chat/completions", CHAT, {"Authorization": "Bearer k1"})
        assert status == 200
        assert (await s.http.get(f"{s.router.url}/health")).status == 200


async def test_concurrency_limit_is_429_with_retry_after() -> None:
    async with stack(1, 1, max_concurrent_requests=1) as s:
        await s.faults(s.decodes[0], hang=True)
        slow = asyncio.create_task(s.post("/generate", {"text": "hi"}))
        await asyncio.sleep(0.2)
        resp = await s.http.post(f"{s.router.url}/generate", json={"text": "hi"})
        assert resp.status == 429
        assert resp.headers["Retry-After"] == "1"
        slow.cancel()


async def test_models_health_metrics_openapi() -> None:
    async with stack(1, 1) as s:
        models = await (await s.http.get(f"{s.router.url}/v1/models")).json()
        assert [m["id"] for m in models["data"]] == ["instant-model"]
        assert (await s.http.get(f"{s.router.url}/readiness")).status == 200
        await s.post("/v1/chat/completions", {**CHAT, "stream": True})
        text = await (await s.http.get(f"{s.router.url}/metrics")).text()
        for name in (
            "tandem_router_requests_total",
            "tandem_router_ttft_seconds_bucket",
            "tandem_router_inter_token_seconds_bucket",
            "tandem_router_e2e_seconds_bucket",
            "tandem_router_worker_in_flight",
        ):
            assert name in text
        assert 'tandem_router_requests_total{route="/v1/chat/completions",status="200"} 1.0' in text
        doc = await (await s.http.get(f"{s.router.url}/openapi.json")).json()
        assert set(doc["paths"]) >= {"/v1/chat/completions", "/v1/completions", "/generate", "/v1/models"}
        assert doc["info"]["version"] == tandem.__version__


async def test_unknown_path_is_openai_404() -> None:
    async with stack(1, 1) as s:
        resp = await s.http.get(f"{s.router.url}/nope")
        assert resp.status == 404
        assert (await resp.json())["error"]["type"] == "not_found_error"


async def test_valid_openai_requests_are_forwarded_canonical() -> None:
    """null means absent and whole floats are integers (OpenAI's parsing; SGLang refuses ``"n": null``), the rest
    of the body exactly as sent (issue 19 item 4)."""
    completion = {"model": "instant-model", "prompt": ["a", "b"], "n": 2.0, "max_tokens": 8.0, "seed": 8811.0,
                  "logprobs": 3, "echo": True, "suffix": "s", "stream": None, "user": None,
                  "temperature": 0.5}  # fmt: skip
    chat = {**CHAT, "n": None, "stream": None, "max_tokens": 4.0, "tools": None, "tool_choice": None, "seed": 1.0}
    async with stack(1, 1) as s:
        status, raw = await s.post("/v1/completions", completion)
        assert status == 200, raw
        status, raw = await s.post("/v1/chat/completions", chat)
        assert status == 200, raw
        got = [r["body"] for r in await s.received(s.decodes[0])]
    sent = {k: v for k, v in got[0].items() if not k.startswith("bootstrap_")}
    assert sent == {"model": "instant-model", "prompt": ["a", "b"], "n": 2, "max_tokens": 8, "seed": 8811,
                    "logprobs": 3, "echo": True, "suffix": "s", "temperature": 0.5}  # fmt: skip
    assert all(type(sent[k]) is int for k in ("n", "max_tokens", "seed"))
    assert len(got[0]["bootstrap_room"]) == 4  # 2 prompts x n=2
    assert {k: v for k, v in got[1].items() if not k.startswith("bootstrap_")} == {**CHAT, "max_tokens": 4, "seed": 1}


@pytest.mark.parametrize(
    ("path", "body", "param"),
    [
        ("/v1/completions", {"model": "instant-model", "prompt": None}, "prompt"),
        ("/v1/completions", {"model": "instant-model", "prompt": [[]]}, "prompt"),
        ("/v1/completions", {"model": "instant-model", "prompt": "x", "n": 2.5}, "n"),
        ("/v1/completions", {"model": "instant-model", "prompt": "x", "best_of": 3}, "best_of"),
        ("/v1/completions", {"model": "instant-model", "prompt": "x", "max_tokens": 2**70 - 1}, "max_tokens"),
        ("/v1/completions", {"model": "instant-model", "prompt": "x", "seed": -(2**70)}, "seed"),
        ("/v1/chat/completions", {**CHAT, "modalities": ["text", "audio"]}, "modalities"),
        ("/v1/chat/completions", {**CHAT, "messages": [{"content": "x"}]}, "messages[0].role"),
    ],
)
async def test_what_tandem_does_not_serve_is_refused_by_name(path: str, body: dict[str, Any], param: str) -> None:
    async with stack(1, 1) as s:
        status, raw = await s.post(path, body)
        assert status == 400, raw
        assert _openai_error(raw)["param"] == param
        assert await s.received(s.decodes[0]) == []


async def test_a_dp_attention_decode_alone_gets_routed_dp_rank() -> None:
    async with stack(1, 1, policy=Policy.CACHE_AWARE) as s:
        decode = s.state.pool.of_role(Role.DECODE)[0].spec
        s.state.pool.upsert(WorkerSpec(Role.DECODE, decode.url, attn_dp_size=2, epoch=1))
        for _ in range(2):
            status, _ = await s.post("/v1/chat/completions", CHAT)
            assert status == 200
        prefill_bodies = [r["body"] for r in await s.received(s.prefills[0])]
        decode_bodies = [r["body"] for r in await s.received(s.decodes[0])]
        assert all("routed_dp_rank" not in b for b in prefill_bodies)  # the prefill follows its room
        assert [b["routed_dp_rank"] for b in decode_bodies] == [0, 0]  # sequential: rank 0 is free again each time
        assert {k: v for k, v in decode_bodies[0].items() if k != "routed_dp_rank"} == prefill_bodies[0]
