"""Parse and validate request bodies of ``/generate``, ``/v1/completions`` and ``/v1/chat/completions``.

Pure functions: body dict in, ``GenerateInput`` out, or ``BadRequestError`` with SGLang's message. Messages
follow SGLang 0.5.23 (``tokenizer_manager._validate_one_request``, OpenAI serving classes).
"""

from __future__ import annotations

import uuid
from dataclasses import dataclass
from typing import Any

from tandem_sim import model

# /generate fields SGLang 0.5.23's GenerateReqInput knows (the contract rejects others).
GENERATE_FIELDS = frozenset(
    {
        "text",
        "input_ids",
        "input_embeds",
        "sampling_params",
        "rid",
        "return_logprob",
        "logprob_start_len",
        "top_logprobs_num",
        "token_ids_logprob",
        "return_text_in_logprobs",
        "stream",
        "stream_options",
        "lora_path",
        "lora_id",
        "custom_logit_processor",
        "bootstrap_host",
        "bootstrap_port",
        "bootstrap_room",
        "bootstrap_pair_key",
        "data_parallel_rank",
        "routed_dp_rank",
        "image_data",
        "video_data",
        "audio_data",
        "modalities",
        "session_params",
        "log_metrics",
        "return_hidden_states",
        "return_routed_experts",
        "priority",
        "extra_key",
        "routing_key",
        "no_logs",
        "custom_labels",
        "return_bytes",
        "conversation_id",
        "label",
        "require_reasoning",
        "return_entropy",
        "external_trace_header",
        "received_time",
    }
)
SAMPLING_FIELDS = frozenset(
    {
        "max_new_tokens",
        "min_new_tokens",
        "temperature",
        "top_p",
        "top_k",
        "min_p",
        "stop",
        "stop_token_ids",
        "stop_regex",
        "ignore_eos",
        "skip_special_tokens",
        "spaces_between_special_tokens",
        "no_stop_trim",
        "n",
        "frequency_penalty",
        "presence_penalty",
        "repetition_penalty",
        "json_schema",
        "regex",
        "ebnf",
        "structural_tag",
        "custom_params",
        "sampling_seed",
        "logit_bias",
        "thinking_budget",
    }
)
MAX_ROOM = 2**63 - 1


class BadRequestError(ValueError):
    def __init__(self, message: str, status: int = 400) -> None:
        super().__init__(message)
        self.status = status


@dataclass(frozen=True)
class Bootstrap:
    host: str
    port: int | None
    room: int


@dataclass(frozen=True)
class GenerateInput:
    rid: str
    input_ids: list[int]
    params: model.SamplingParams
    stream: bool
    bootstrap: Bootstrap | None


def _number(value: Any, name: str, kind: type, lo: float | None = None) -> Any:
    if isinstance(value, bool) or not isinstance(value, int | float) or (kind is int and not isinstance(value, int)):
        raise BadRequestError(f"{name} must be {'an integer' if kind is int else 'a number'}, got {value!r}")
    if lo is not None and value < lo:
        raise BadRequestError(f"{name} must be at least {lo}, got {value}")
    return value


def sampling_params(raw: Any, *, context_length: int, prompt_len: int, default_max: int) -> model.SamplingParams:
    if raw is None:
        raw = {}
    if not isinstance(raw, dict):
        raise BadRequestError("sampling_params must be an object")
    unknown = sorted(set(raw) - SAMPLING_FIELDS)
    if unknown:
        raise BadRequestError(f"Unknown sampling parameter(s): {', '.join(unknown)}")
    max_new = raw.get("max_new_tokens")
    max_new = default_max if max_new is None else _number(max_new, "max_new_tokens", int, 0)
    if prompt_len >= context_length:
        raise BadRequestError(
            f"The input ({prompt_len} tokens) is longer than the model's context length ({context_length} tokens)."
        )
    if raw.get("max_new_tokens") is None:
        max_new = min(max_new, context_length - prompt_len)
    if prompt_len + max_new > context_length:
        raise BadRequestError(
            f"Requested token count exceeds the model's maximum context length of {context_length} tokens. "
            f"You requested a total of {prompt_len + max_new} tokens: {prompt_len} tokens from the input messages "
            f"and {max_new} tokens for the completion. Please reduce the number of tokens in the input messages "
            "or the completion to fit within the limit."
        )
    temperature = float(_number(raw.get("temperature", 1.0), "temperature", float, 0))
    top_p = float(_number(raw.get("top_p", 1.0), "top_p", float))
    if not 0 < top_p <= 1:
        raise BadRequestError(f"top_p must be in (0, 1], got {top_p}.")
    top_k = int(_number(raw.get("top_k", -1), "top_k", int))
    if top_k < -1 or top_k == 0:
        raise BadRequestError(f"top_k must be -1 (disable) or at least 1, got {top_k}.")
    min_new = int(_number(raw.get("min_new_tokens", 0), "min_new_tokens", int, 0))
    if min_new > max_new:
        raise BadRequestError(f"min_new_tokens must be in [0, max_new_tokens({max_new})], got {min_new}.")
    stop = raw.get("stop") or ()
    if isinstance(stop, str):
        stop = (stop,)
    if not isinstance(stop, list | tuple) or not all(isinstance(s, str) for s in stop):
        raise BadRequestError("stop must be a string or a list of strings")
    seed = raw.get("sampling_seed")
    return model.SamplingParams(
        max_new_tokens=int(max_new),
        min_new_tokens=min_new,
        temperature=temperature,
        top_p=top_p,
        top_k=top_k,
        ignore_eos=bool(raw.get("ignore_eos", False)),
        stop=tuple(stop),
        sampling_seed=None if seed is None else int(_number(seed, "sampling_seed", int)),
    )


def bootstrap_fields(body: dict[str, Any], mode: str) -> Bootstrap | None:
    host, port, room = body.get("bootstrap_host"), body.get("bootstrap_port"), body.get("bootstrap_room")
    if mode == "null":
        return None
    if host is None or room is None:
        raise BadRequestError(
            f"Disaggregated {mode} request requires bootstrap_host and bootstrap_room (got "
            f"bootstrap_host={host!r}, bootstrap_room={room!r})"
        )
    if not isinstance(host, str) or not host:
        raise BadRequestError(f"bootstrap_host must be a non-empty string, got {host!r}")
    if port is not None and (isinstance(port, bool) or not isinstance(port, int) or not 0 < port < 65536):
        raise BadRequestError(f"bootstrap_port must be an integer port or null, got {port!r}")
    if isinstance(room, bool) or not isinstance(room, int) or not 0 <= room <= MAX_ROOM:
        raise BadRequestError(f"bootstrap_room must be an integer in [0, 2^63-1], got {room!r}")
    return Bootstrap(host, port, room)


def prompt_ids(text: Any, input_ids: Any) -> list[int]:
    if text is not None and input_ids is not None:
        raise BadRequestError("Either text or input_ids should be provided, not both.")
    if input_ids is not None:
        if (
            not isinstance(input_ids, list)
            or not input_ids
            or not all(isinstance(t, int) and not isinstance(t, bool) and 0 <= t < model.VOCAB_SIZE for t in input_ids)
        ):
            raise BadRequestError(f"input_ids must be a non-empty list of token ids in [0, {model.VOCAB_SIZE})")
        return list(input_ids)
    if not isinstance(text, str):
        raise BadRequestError("Either text or input_ids should be provided.")
    ids = model.encode(text)
    if not ids:
        raise BadRequestError("The input is empty.")
    return ids


def parse_generate(body: Any, *, mode: str, context_length: int) -> GenerateInput:
    if not isinstance(body, dict):
        raise BadRequestError("Request body must be a JSON object")
    unknown = sorted(set(body) - GENERATE_FIELDS)
    if unknown:
        raise BadRequestError(f"Unknown field(s) in /generate request: {', '.join(unknown)}")
    if isinstance(body.get("text"), list) or (
        isinstance(body.get("input_ids"), list) and body["input_ids"] and isinstance(body["input_ids"][0], list)
    ):
        raise BadRequestError("Batch requests are not supported by the simulator; send one prompt per request.")
    ids = prompt_ids(body.get("text"), body.get("input_ids"))
    params = sampling_params(
        body.get("sampling_params"), context_length=context_length, prompt_len=len(ids), default_max=128
    )
    rid = body.get("rid") or uuid.uuid4().hex
    return GenerateInput(str(rid), ids, params, bool(body.get("stream", False)), bootstrap_fields(body, mode))


def _openai_sampling(body: dict[str, Any]) -> dict[str, Any]:
    raw: dict[str, Any] = {}
    max_tokens = body.get("max_completion_tokens", body.get("max_tokens"))
    if max_tokens is not None:
        raw["max_new_tokens"] = max_tokens
    for src, dst in (
        ("temperature", "temperature"),
        ("top_p", "top_p"),
        ("top_k", "top_k"),
        ("stop", "stop"),
        ("ignore_eos", "ignore_eos"),
        ("min_tokens", "min_new_tokens"),
        ("seed", "sampling_seed"),
    ):
        if body.get(src) is not None:
            raw[dst] = body[src]
    n = body.get("n", 1)
    if n != 1:
        raise BadRequestError("n > 1 is not supported by the simulator")
    return raw


def parse_openai(body: Any, *, chat: bool, mode: str, context_length: int) -> GenerateInput:
    if not isinstance(body, dict):
        raise BadRequestError("Request body must be a JSON object")
    if not isinstance(body.get("model"), str):
        raise BadRequestError("model: Field required")
    if chat:
        messages = body.get("messages")
        if not isinstance(messages, list) or not messages:
            raise BadRequestError("messages: Field required (a non-empty list)")
        turns = []
        for i, msg in enumerate(messages):
            if not isinstance(msg, dict) or not isinstance(msg.get("role"), str):
                raise BadRequestError(f"messages[{i}]: must be an object with a role")
            content = msg.get("content")
            if isinstance(content, list):
                content = " ".join(str(p.get("text", "")) for p in content if isinstance(p, dict))
            turns.append((msg["role"], "" if content is None else str(content)))
        ids = model.encode(model.apply_chat_template(turns))
    else:
        prompt = body.get("prompt")
        if isinstance(prompt, list) and prompt and all(isinstance(t, int) for t in prompt):
            ids = prompt_ids(None, prompt)
        elif isinstance(prompt, list) and len(prompt) == 1 and isinstance(prompt[0], str):
            ids = prompt_ids(prompt[0], None)
        elif isinstance(prompt, str):
            ids = prompt_ids(prompt, None)
        else:
            raise BadRequestError("prompt: must be a string, a list of one string or a list of token ids")
    params = sampling_params(
        _openai_sampling(body), context_length=context_length, prompt_len=len(ids), default_max=context_length
    )
    rid = body.get("rid") or uuid.uuid4().hex
    return GenerateInput(str(rid), ids, params, bool(body.get("stream", False)), bootstrap_fields(body, mode))
