"""Response bodies in SGLang 0.5.23's shapes (native ``/generate`` and the OpenAI-compatible API). Pure."""

from __future__ import annotations

import time
from dataclasses import dataclass, field
from typing import Any

import orjson


@dataclass
class Outcome:
    """What one request produced so far."""

    rid: str
    prompt_tokens: int
    output_ids: list[int] = field(default_factory=list)
    text: str = ""
    finish_reason: dict[str, Any] | None = None
    started: float = field(default_factory=time.monotonic)


def sse(doc: Any) -> bytes:
    return b"data: " + orjson.dumps(doc) + b"\n\n"


SSE_DONE = b"data: [DONE]\n\n"


def meta_info(out: Outcome) -> dict[str, Any]:
    return {
        "id": out.rid,
        "finish_reason": out.finish_reason,
        "prompt_tokens": out.prompt_tokens,
        "completion_tokens": len(out.output_ids),
        "cached_tokens": 0,
        "weight_version": "default",
        "e2e_latency": time.monotonic() - out.started,
    }


def generate_body(out: Outcome) -> dict[str, Any]:
    return {"text": out.text, "output_ids": list(out.output_ids), "meta_info": meta_info(out)}


def generate_error(message: str, status: int) -> dict[str, Any]:
    """``/generate`` error body (``http_server._create_error_response``)."""
    return {"error": {"message": message}}


def generate_stream_error(message: str, status: int) -> dict[str, Any]:
    return {"error": {"message": message, "type": "invalid_request_error", "code": status, "retryable": False}}


def openai_error(message: str, status: int, err_type: str | None = None) -> dict[str, Any]:
    if err_type is None:
        err_type = "BadRequestError" if status < 500 else "InternalServerError"
    return {"object": "error", "message": message, "type": err_type, "param": None, "code": status}


def openai_finish(out: Outcome) -> tuple[str | None, Any]:
    fr = out.finish_reason
    if fr is None:
        return None, None
    kind = fr.get("type")
    if kind == "abort":
        return "abort", None
    return ("stop" if kind == "stop" else "length"), fr.get("matched")


def usage(out: Outcome) -> dict[str, Any]:
    return {
        "prompt_tokens": out.prompt_tokens,
        "completion_tokens": len(out.output_ids),
        "total_tokens": out.prompt_tokens + len(out.output_ids),
        "prompt_tokens_details": None,
        "reasoning_tokens": 0,
    }


def completion_body(out: Outcome, model_name: str, created: int) -> dict[str, Any]:
    reason, matched = openai_finish(out)
    return {
        "id": out.rid,
        "object": "text_completion",
        "created": created,
        "model": model_name,
        "choices": [{"index": 0, "text": out.text, "logprobs": None, "finish_reason": reason, "matched_stop": matched}],
        "usage": usage(out),
    }


def chat_body(out: Outcome, model_name: str, created: int) -> dict[str, Any]:
    reason, matched = openai_finish(out)
    message = {"role": "assistant", "content": out.text, "reasoning_content": None, "tool_calls": None}
    return {
        "id": out.rid,
        "object": "chat.completion",
        "created": created,
        "model": model_name,
        "choices": [
            {"index": 0, "message": message, "logprobs": None, "finish_reason": reason, "matched_stop": matched}
        ],
        "usage": usage(out),
    }


def completion_chunk(
    out: Outcome, model_name: str, created: int, text: str, final: bool, with_usage: bool
) -> dict[str, Any]:
    reason, matched = openai_finish(out) if final else (None, None)
    return {
        "id": out.rid,
        "object": "text_completion",
        "created": created,
        "model": model_name,
        "choices": [{"index": 0, "text": text, "logprobs": None, "finish_reason": reason, "matched_stop": matched}],
        "usage": usage(out) if with_usage else None,
    }


def chat_chunk(
    out: Outcome, model_name: str, created: int, delta: dict[str, Any], final: bool, with_usage: bool
) -> dict[str, Any]:
    reason, matched = openai_finish(out) if final else (None, None)
    return {
        "id": out.rid,
        "object": "chat.completion.chunk",
        "created": created,
        "model": model_name,
        "choices": [{"index": 0, "delta": delta, "logprobs": None, "finish_reason": reason, "matched_stop": matched}],
        "usage": usage(out) if with_usage else None,
    }


def usage_chunk(out: Outcome, model_name: str, created: int, chat: bool) -> dict[str, Any]:
    return {
        "id": out.rid,
        "object": "chat.completion.chunk" if chat else "text_completion",
        "created": created,
        "model": model_name,
        "choices": [],
        "usage": usage(out),
    }
