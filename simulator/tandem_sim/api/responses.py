"""Response bodies in SGLang 0.5.23's shapes (native ``/generate`` and the OpenAI-compatible API). Pure."""

from __future__ import annotations

import hashlib
import time
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any

import orjson

from tandem_sim.model.numerics import StepLogprobs

LogprobEntry = tuple[float, int, str]  # (logprob, token id, token text): SGLang's triple


@dataclass
class Outcome:
    """What one request produced so far."""

    rid: str
    prompt_tokens: int
    output_ids: list[int] = field(default_factory=list)
    text: str = ""
    finish_reason: dict[str, Any] | None = None
    cached_tokens: int = 0  # prompt tokens served by the radix cache (SGLang's req.cached_tokens)
    started: float = field(default_factory=time.monotonic)
    top_logprobs_num: int | None = None  # logprobs asked for (``return_logprob``), with the top k of each token
    text_in_logprobs: bool = False  # ``return_text_in_logprobs``: the token text in each triple (else null)
    token_logprobs: list[LogprobEntry] = field(default_factory=list)  # one per output token
    top_logprobs: list[list[LogprobEntry]] = field(default_factory=list)  # one list per output token (k > 0)

    def add_logprobs(self, step: StepLogprobs, word: str, spaced: bool) -> None:
        """The logprobs of the output token just added (``word``). A token's text is its word with the separator
        before it (``spaced``: not the answer's first word, or the prompt ends in a word), so the token texts
        concatenate to the text, as a tiktoken-style tokenizer decodes single tokens."""
        prefix = " " if spaced else ""
        self.token_logprobs.append((step.chosen.logprob, step.chosen.token, prefix + word))
        if self.top_logprobs_num:
            self.top_logprobs.append([(c.logprob, c.token, prefix + c.word) for c in step.top(self.top_logprobs_num)])


def sse(doc: Any) -> bytes:
    return b"data: " + orjson.dumps(doc) + b"\n\n"


SSE_DONE = b"data: [DONE]\n\n"


def meta_info(out: Outcome) -> dict[str, Any]:
    info: dict[str, Any] = {
        "id": out.rid,
        "finish_reason": out.finish_reason,
        "prompt_tokens": out.prompt_tokens,
        "completion_tokens": len(out.output_ids),
        "cached_tokens": out.cached_tokens,
        "weight_version": "default",
        "e2e_latency": time.monotonic() - out.started,
    }
    if out.top_logprobs_num is not None:
        info.update(logprob_meta_info(out))
    return info


def _triple(entry: LogprobEntry, text: bool) -> list[Any]:
    return [entry[0], entry[1], entry[2] if text else None]


def logprob_meta_info(out: Outcome) -> dict[str, Any]:
    """``return_logprob`` fields of ``meta_info`` (``TokenizerManager.convert_logprob_style`` ->
    ``add_logprob_to_meta_info``, ``detokenize_logprob_tokens``): ``[logprob, token_id, text or null]`` per output
    token, cumulative in every streamed chunk; input logprobs are empty (SGLang's default ``logprob_start_len`` -1
    means the output tokens only)."""
    text = out.text_in_logprobs
    info: dict[str, Any] = {
        "input_token_logprobs": [],
        "output_token_logprobs": [_triple(e, text) for e in out.token_logprobs],
        "output_token_logprobs_length": len(out.token_logprobs),
    }
    if out.top_logprobs_num:
        info["input_top_logprobs"] = []
        info["output_top_logprobs"] = [[_triple(e, text) for e in row] for row in out.top_logprobs]
    return info


def chat_logprobs(out: Outcome, start: int = 0, end: int | None = None) -> dict[str, Any] | None:
    """A chat choice's ``logprobs`` for output tokens ``start:end`` (``serving_chat._build_token_logprobs_from_raw``:
    ``{"content": [{token, bytes, logprob, top_logprobs: [{token, bytes, logprob}]}]}``); None when not asked for."""
    if out.top_logprobs_num is None:
        return None
    tops = out.top_logprobs[start:end] if out.top_logprobs_num else []
    content = []
    for i, (logprob, _, text) in enumerate(out.token_logprobs[start:end]):
        row = tops[i] if i < len(tops) else []
        top = [{"token": t, "bytes": list(t.encode()), "logprob": lp} for lp, _, t in row]
        content.append({"token": text, "bytes": list(text.encode()), "logprob": logprob, "top_logprobs": top})
    return {"content": content}


def completion_logprobs(out: Outcome, start: int = 0, end: int | None = None) -> dict[str, Any] | None:
    """A completions choice's ``logprobs`` for output tokens ``start:end`` (``openai/utils.to_openai_style_logprobs``:
    ``text_offset`` is -1 per token, "not supported yet"); None when not asked for."""
    if out.top_logprobs_num is None:
        return None
    entries = out.token_logprobs[start:end]
    return {
        "text_offset": [-1] * len(entries),
        "token_logprobs": [lp for lp, _, _ in entries],
        "tokens": [text for _, _, text in entries],
        "top_logprobs": [{t: lp for lp, _, t in row} for row in out.top_logprobs[start:end]],
    }


def generate_body(out: Outcome, index: int | None = None, prompt_ids: list[int] | None = None) -> dict[str, Any]:
    """``prompt_ids``: the request asked for ``return_prompt_token_ids`` (``TokenizerManager._handle_batch_output``
    adds ``prompt_token_ids`` to every answer and streamed chunk)."""
    body: dict[str, Any] = {"text": out.text, "output_ids": list(out.output_ids), "meta_info": meta_info(out)}
    if prompt_ids is not None:
        body["prompt_token_ids"] = prompt_ids
    if index is not None:
        body["index"] = index  # a streamed batch item
    return body


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


def usage(outs: Sequence[Outcome], n: int = 1) -> dict[str, Any]:
    """Usage of prompt-major choices, ``n`` per prompt: each prompt counted once, every choice's completion tokens
    (``UsageProcessor.calculate_response_usage``)."""
    prompt = sum(o.prompt_tokens for o in outs[::n])
    completion = sum(len(o.output_ids) for o in outs)
    return {
        "prompt_tokens": prompt,
        "completion_tokens": completion,
        "total_tokens": prompt + completion,
        "prompt_tokens_details": None,
        "reasoning_tokens": 0,
    }


def tool_calls(out: Outcome, name: str) -> list[dict[str, Any]]:
    """The call a choice makes when the tool choice forces one (arguments: the generated text, as JSON)."""
    call_id = "call_" + hashlib.blake2b(f"{out.rid}:{name}".encode(), digest_size=12).hexdigest()
    arguments = orjson.dumps({"text": out.text}).decode()
    return [{"id": call_id, "index": 0, "type": "function", "function": {"name": name, "arguments": arguments}}]


def completion_body(
    outs: Sequence[Outcome], model_name: str, created: int, n: int = 1, echo: Sequence[str] = ()
) -> dict[str, Any]:
    """``echo``: each choice's prompt text, put in front of its text (``_prepare_echo_prompts``)."""
    choices = []
    for index, out in enumerate(outs):
        reason, matched = openai_finish(out)
        text = echo[index] + out.text if echo else out.text
        logprobs = completion_logprobs(out)
        choice = {"index": index, "text": text, "logprobs": logprobs, "finish_reason": reason, "matched_stop": matched}
        choices.append(choice)
    return {
        "id": outs[0].rid,
        "object": "text_completion",
        "created": created,
        "model": model_name,
        "choices": choices,
        "usage": usage(outs, n),
    }


def chat_message(out: Outcome, tool_call: str | None) -> tuple[dict[str, Any], str | None, Any]:
    """(message, finish_reason, matched_stop) of one chat choice. SGLang's ``ChatMessage`` drops ``tool_calls``
    when it is null."""
    reason, matched = openai_finish(out)
    if tool_call is not None and reason is not None:
        calls = tool_calls(out, tool_call)
        message = {"role": "assistant", "content": None, "reasoning_content": None, "tool_calls": calls}
        return message, "tool_calls", None
    return {"role": "assistant", "content": out.text, "reasoning_content": None}, reason, matched


def chat_body(outs: Sequence[Outcome], model_name: str, created: int, tool_call: str | None) -> dict[str, Any]:
    choices = []
    for index, out in enumerate(outs):
        message, reason, matched = chat_message(out, tool_call)
        logprobs = chat_logprobs(out)
        choices.append(
            {"index": index, "message": message, "logprobs": logprobs, "finish_reason": reason, "matched_stop": matched}
        )
    return {
        "id": outs[0].rid,
        "object": "chat.completion",
        "created": created,
        "model": model_name,
        "choices": choices,
        "usage": usage(outs),
    }


def completion_chunk(
    out: Outcome,
    index: int,
    model_name: str,
    created: int,
    text: str,
    final: bool,
    with_usage: bool,
    logprobs: dict[str, Any] | None = None,
) -> dict[str, Any]:
    reason, matched = openai_finish(out) if final else (None, None)
    choice = {"index": index, "text": text, "logprobs": logprobs, "finish_reason": reason, "matched_stop": matched}
    return {
        "id": out.rid,
        "object": "text_completion",
        "created": created,
        "model": model_name,
        "choices": [choice],
        "usage": usage([out]) if with_usage else None,
    }


def chat_chunk(
    out: Outcome,
    index: int,
    model_name: str,
    created: int,
    delta: dict[str, Any],
    finish: tuple[str | None, Any],
    with_usage: bool,
    logprobs: dict[str, Any] | None = None,
) -> dict[str, Any]:
    reason, matched = finish
    return {
        "id": out.rid,
        "object": "chat.completion.chunk",
        "created": created,
        "model": model_name,
        "choices": [
            {"index": index, "delta": delta, "logprobs": logprobs, "finish_reason": reason, "matched_stop": matched}
        ],
        "usage": usage([out]) if with_usage else None,
    }


def usage_chunk(outs: Sequence[Outcome], model_name: str, created: int, chat: bool, n: int = 1) -> dict[str, Any]:
    return {
        "id": outs[0].rid,
        "object": "chat.completion.chunk" if chat else "text_completion",
        "created": created,
        "model": model_name,
        "choices": [],
        "usage": usage(outs, n),
    }
