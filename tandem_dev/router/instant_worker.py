"""An *instant* PD worker: a real loopback HTTP server that answers like an SGLang prefill or decode server at
once (prefill: a JSON body; decode: 16 SSE chunks, or ``--chunks`` paced ``--chunk-interval-s`` apart), so a
benchmark measures the router's own cost and tests can exercise the router against real sockets with scripted
faults.

It checks what a PD router must send (``bootstrap_host``, ``bootstrap_port``, ``bootstrap_room`` with one room per
item for batches) and answers 400 otherwise, keeps the recent bodies it received (``GET /_requests``), and takes
faults through ``POST /_faults``: ``{"status": 503, "count": 2}`` fails the next two requests (with ``"body"`` as
the JSON error body when given), ``{"break_after": 3}`` cuts the next stream after 3 chunks,
``{"stream_error": true}`` starts the next stream with an error event (``"stream_error_code"``, default 500),
``{"hang": true}`` never answers the next request, ``{"delay_s": 0.2}`` delays every answer.

``python -m tandem_dev.router.instant_worker --role decode --port 31000``
"""

from __future__ import annotations

import argparse
import asyncio
import time
from collections import deque
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any

import orjson
import uvloop
from aiohttp import web

from tandem.sglang_args import SGLANG_HTTP_BACKLOG

MODEL = "instant-model"
CHUNKS = 16


@dataclass
class Faults:
    status: int = 0
    count: int = 0
    break_after: int = -1
    stream_error: bool = False
    stream_error_code: int = 500
    hang: bool = False
    delay_s: float = 0.0
    body: dict[str, Any] | None = None


@dataclass
class WorkerState:
    role: str
    chunks: int = CHUNKS
    interval_s: float = 0.0  # between two chunks of a stream (0: back to back)
    record: bool = True
    received: deque[dict[str, Any]] = field(default_factory=lambda: deque(maxlen=1000))
    total: int = 0
    faults: Faults = field(default_factory=Faults)
    in_flight: int = 0


_STATE: web.AppKey[WorkerState] = web.AppKey("instant_worker", WorkerState)


def _chunk_bytes(route: str, i: int) -> bytes:
    if route == "/v1/chat/completions":
        doc: dict[str, Any] = {
            "id": "chatcmpl-instant",
            "object": "chat.completion.chunk",
            "model": MODEL,
            "choices": [{"index": 0, "delta": {"content": f"tok{i} "}, "finish_reason": None}],
        }
    elif route == "/v1/completions":
        doc = {
            "id": "cmpl-instant",
            "object": "text_completion",
            "model": MODEL,
            "choices": [{"index": 0, "text": f"tok{i} ", "finish_reason": None}],
        }
    else:
        doc = {"text": f"tok{i} ", "meta_info": {"completion_tokens": i + 1}}
    return b"data: " + orjson.dumps(doc) + b"\n\n"


def _with_usage(chunk: bytes, i: int) -> bytes:
    """A chat chunk carrying the usage so far (SGLang's ``continuous_usage_stats``)."""
    doc = orjson.loads(chunk[len(b"data: ") :])
    doc["usage"] = {"prompt_tokens": 4, "completion_tokens": i + 1, "total_tokens": 5 + i}
    return b"data: " + orjson.dumps(doc) + b"\n\n"


_STREAMS = {
    r: [_chunk_bytes(r, i) for i in range(CHUNKS)] for r in ("/v1/chat/completions", "/v1/completions", "/generate")
}


def _stream_chunks(route: str, chunks: int) -> list[bytes]:
    ready = _STREAMS.get(route, _STREAMS["/generate"])
    if chunks <= len(ready):
        return ready[:chunks]
    route = route if route in _STREAMS else "/generate"
    _STREAMS[route] = ready = [_chunk_bytes(route, i) for i in range(chunks)]  # longer streams: made once
    return ready


def _full_body(route: str, chunks: int) -> bytes:
    text = "".join(f"tok{i} " for i in range(chunks))
    usage = {"prompt_tokens": 4, "completion_tokens": chunks, "total_tokens": 4 + chunks}
    if route == "/v1/chat/completions":
        return orjson.dumps(
            {
                "id": "chatcmpl-instant",
                "object": "chat.completion",
                "created": 0,
                "model": MODEL,
                "choices": [{"index": 0, "message": {"role": "assistant", "content": text}, "finish_reason": "length"}],
                "usage": usage,
            }
        )
    if route == "/v1/completions":
        return orjson.dumps(
            {
                "id": "cmpl-instant",
                "object": "text_completion",
                "created": 0,
                "model": MODEL,
                "choices": [{"index": 0, "text": text, "finish_reason": "length"}],
                "usage": usage,
            }
        )
    return orjson.dumps(
        {
            "text": text,
            "meta_info": {
                "prompt_tokens": 4,
                "completion_tokens": chunks,
                "finish_reason": {"type": "length", "length": chunks},
            },
        }
    )


def _bootstrap_problem(body: dict[str, Any]) -> str | None:
    rooms = body.get("bootstrap_room")
    host = body.get("bootstrap_host")
    if rooms is None or host is None or "bootstrap_port" not in body:
        return "missing bootstrap_host/bootstrap_port/bootstrap_room"
    room_list = rooms if isinstance(rooms, list) else [rooms]
    if not all(isinstance(r, int) and 0 <= r <= 2**63 - 1 for r in room_list):
        return "bootstrap_room out of range"
    if isinstance(rooms, list) and not (isinstance(host, list) and len(host) == len(rooms)):
        return "batch bootstrap fields must be lists of one length"
    return None


async def _serve(request: web.Request) -> web.StreamResponse:
    s = request.app[_STATE]
    s.total += 1
    body = orjson.loads(await request.read())
    if s.record:
        s.received.append({"path": request.path, "body": body, "request_id": request.headers.get("X-Request-Id")})
    problem = _bootstrap_problem(body)
    if problem is not None:
        return web.json_response(
            {"error": {"message": problem, "type": "invalid_request_error", "code": 400}}, status=400
        )
    f = s.faults
    if f.hang:
        f.hang = False
        await asyncio.sleep(3600)
    if f.delay_s:
        await asyncio.sleep(f.delay_s)
    if f.count > 0:
        f.count -= 1
        return web.json_response(f.body or {"detail": f"injected failure {f.status}"}, status=f.status)
    if s.role == "prefill":
        return web.Response(
            body=b'{"text":"","meta_info":{"finish_reason":{"type":"length","length":0}}}',
            content_type="application/json",
        )
    if not body.get("stream"):
        return web.Response(body=_full_body(request.path, s.chunks), content_type="application/json")
    resp = web.StreamResponse(headers={"Content-Type": "text/event-stream"})
    await resp.prepare(request)
    if f.stream_error:
        f.stream_error = False
        error = {"object": "error", "message": "injected KV transfer failure", "code": f.stream_error_code}
        await resp.write(b"data: " + orjson.dumps({"error": error}) + b"\n\n")
        return resp
    chunks = _stream_chunks(request.path, s.chunks)
    options = body.get("stream_options")
    if request.path == "/v1/chat/completions" and isinstance(options, dict) and options.get("continuous_usage_stats"):
        chunks = [_with_usage(chunk, i) for i, chunk in enumerate(chunks)]
    s.in_flight += 1
    started = time.monotonic()
    try:
        for i, chunk in enumerate(chunks):
            if i == f.break_after:
                f.break_after = -1
                request.transport.close() if request.transport is not None else None
                return resp
            if s.interval_s and i:  # paced from the stream's start: a late chunk does not delay the next ones
                await asyncio.sleep(max(0.0, started + i * s.interval_s - time.monotonic()))
            await resp.write(chunk)
        await resp.write(b"data: [DONE]\n\n")
    finally:
        s.in_flight -= 1
    return resp


async def _faults(request: web.Request) -> web.Response:
    s = request.app[_STATE]
    s.faults = Faults(**orjson.loads(await request.read()))
    return web.json_response({"ok": True})


async def _requests(request: web.Request) -> web.Response:
    s = request.app[_STATE]
    return web.Response(
        body=orjson.dumps({"total": s.total, "recent": list(s.received)}), content_type="application/json"
    )


async def _health(request: web.Request) -> web.Response:
    return web.Response(text="OK")


async def _models(request: web.Request) -> web.Response:
    return web.json_response({"object": "list", "data": [{"id": MODEL, "object": "model", "owned_by": "sglang"}]})


async def _info(request: web.Request) -> web.Response:
    """Enough of ``/server_info`` and ``/model_info`` for SGLang's own gateway to accept this worker."""
    s = request.app[_STATE]
    return web.json_response(
        {
            "model_path": MODEL,
            "served_model_name": MODEL,
            "disaggregation_mode": s.role,
            "tp_size": 1,
            "dp_size": 1,
            "is_generation": True,
            "max_total_num_tokens": 65536,
            "version": "instant",
            "internal_states": [{}],
        }
    )


async def _metrics(request: web.Request) -> web.Response:
    s = request.app[_STATE]
    text = (
        f'# TYPE sglang:num_running_reqs gauge\nsglang:num_running_reqs{{model_name="{MODEL}"}} {s.in_flight}\n'
        f'# TYPE sglang:num_queue_reqs gauge\nsglang:num_queue_reqs{{model_name="{MODEL}"}} 0\n'
        f'# TYPE sglang:token_usage gauge\nsglang:token_usage{{model_name="{MODEL}"}} 0.0\n'
    )
    return web.Response(text=text, content_type="text/plain")


def build_app(role: str, *, chunks: int = CHUNKS, interval_s: float = 0.0, record: bool = True) -> web.Application:
    if role not in {"prefill", "decode"}:
        raise ValueError(f"role must be prefill or decode, got {role!r}")
    app = web.Application()
    app[_STATE] = WorkerState(role, chunks, interval_s, record)
    for path in ("/generate", "/v1/chat/completions", "/v1/completions"):
        app.router.add_post(path, _serve)
    app.router.add_post("/_faults", _faults)
    app.router.add_get("/_requests", _requests)
    app.router.add_get("/health", _health)
    app.router.add_get("/v1/models", _models)
    app.router.add_get("/metrics", _metrics)
    for path in ("/server_info", "/get_server_info", "/model_info", "/get_model_info"):
        app.router.add_get(path, _info)
    app.router.add_get("/health_generate", _health)
    return app


def main(argv: Sequence[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m tandem_dev.router.instant_worker", description=__doc__)
    p.add_argument("--role", choices=["prefill", "decode"], required=True)
    p.add_argument("--host", default="127.0.0.1")
    p.add_argument("--port", type=int, required=True)
    p.add_argument("--chunks", type=int, default=CHUNKS)
    p.add_argument("--chunk-interval-s", type=float, default=0.0, help="pace a stream's chunks this far apart")
    p.add_argument("--no-record", action="store_true", help="do not keep received bodies (benchmarks)")
    args = p.parse_args(argv)
    started = time.monotonic()
    app = build_app(args.role, chunks=args.chunks, interval_s=args.chunk_interval_s, record=not args.no_record)
    print(f"instant {args.role} worker on {args.host}:{args.port} ({time.monotonic() - started:.3f}s)", flush=True)
    web.run_app(
        app,
        host=args.host,
        port=args.port,
        access_log=None,
        print=None,
        loop=uvloop.new_event_loop(),
        backlog=SGLANG_HTTP_BACKLOG,  # SGLang's accept queue, not aiohttp's 128: a burst is queued as it would be there
    )
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
