"""Parse and validate ``/generate`` bodies (single and batch); shared parts of the OpenAI parsing.

Pure functions: body dict in, ``GenerateInput`` out, or ``BadRequestError`` with SGLang's message. Messages
follow SGLang 0.5.23 (``tokenizer_manager._validate_one_request``, OpenAI serving classes).
"""

from __future__ import annotations

import math
import uuid
from dataclasses import dataclass
from typing import Any

from tandem_sim.api import contract
from tandem_sim.api.sglang_fields import GENERATE_FIELDS, ignored_fields
from tandem_sim.model import model

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
    prompt: model.Tokens
    params: model.SamplingParams
    stream: bool
    bootstrap: Bootstrap | None
    routed_dp_rank: int | None = None  # the attention-DP rank the client asked for (decode and aggregated only)
    top_logprobs_num: int | None = None  # ``return_logprob``: the output tokens' logprobs and the top k of each
    return_text_in_logprobs: bool = False  # each logprob triple carries the token's text (else null)

    @property
    def input_ids(self) -> list[int]:
        return self.prompt.ids

    @property
    def continues_text(self) -> bool:
        """The output's first word carries its separator when the prompt ends in a word (not a template marker):
        SGLang decodes output ids after the prompt's last tokens and keeps only the new text
        (``Req.init_incremental_detokenize``: ``surr_offset`` = ``read_offset`` - 5;
        ``DetokenizerManager``: ``read_texts[i][len(surr_texts[i]):]``), so a continued text (an assistant prefix,
        a completions prompt, ``input_ids`` that end mid-answer) plus its output is the whole text, as with a
        concatenative tokenizer (tiktoken, Kimi's)."""
        return bool(self.prompt.ids) and self.prompt.ids[-1] >= model.FIRST_WORD_ID


def _number(value: Any, name: str, kind: type) -> Any:
    if isinstance(value, bool) or not isinstance(value, int | float) or (kind is int and not isinstance(value, int)):
        raise BadRequestError(f"{name} must be {'an integer' if kind is int else 'a number'}, got {value!r}")
    return value


def sampling_params(raw: Any, *, context_length: int, prompt_len: int, default_max: int) -> model.SamplingParams:
    if raw is None:
        raw = {}
    if not isinstance(raw, dict):
        raise BadRequestError("sampling_params must be an object")
    max_new = raw.get("max_new_tokens")
    max_new = default_max if max_new is None else _number(max_new, "max_new_tokens", int)
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
    # Value checks in the order and words of SGLang's ``SamplingParams.verify`` (sampling/sampling_params.py).
    raw_temperature = _number(raw.get("temperature", 1.0), "temperature", float)
    if not math.isfinite(raw_temperature) or raw_temperature < 0:
        raise BadRequestError(f"temperature must be a non-negative finite number, got {raw_temperature}.")
    temperature = float(raw_temperature)
    top_p = float(_number(raw.get("top_p", 1.0), "top_p", float))
    if not 0 < top_p <= 1:
        raise BadRequestError(f"top_p must be in (0, 1], got {top_p}.")
    top_k = int(_number(raw.get("top_k", -1), "top_k", int))
    if top_k < -1 or top_k == 0:
        raise BadRequestError(f"top_k must be -1 (disable) or at least 1, got {top_k}.")
    if max_new < 0:
        raise BadRequestError(f"max_new_tokens must be at least 0, got {max_new}.")
    min_new = int(_number(raw.get("min_new_tokens", 0), "min_new_tokens", int))
    if not 0 <= min_new <= max_new:
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


def prompt_tokens(text: Any, input_ids: Any) -> model.Tokens:
    if text is not None and input_ids is not None:
        raise BadRequestError("Either text or input_ids should be provided, not both.")
    if input_ids is not None:
        if (
            not isinstance(input_ids, list)
            or not input_ids
            or not all(isinstance(t, int) and not isinstance(t, bool) and 0 <= t < model.VOCAB_SIZE for t in input_ids)
        ):
            raise BadRequestError(f"input_ids must be a non-empty list of token ids in [0, {model.VOCAB_SIZE})")
        return model.from_ids(input_ids)
    if not isinstance(text, str):
        raise BadRequestError("Either text or input_ids should be provided.")
    tokens = model.tokenize(text)
    if not tokens.ids:
        raise BadRequestError("The input is empty.")
    return tokens


@dataclass(frozen=True)
class ParsedRequest:
    """One HTTP request: one item per prompt and sample (``n``), each with its own bootstrap room in PD mode."""

    items: list[GenerateInput]
    batch: bool  # /generate answers a list
    stream: bool
    ignored: tuple[str, ...] = ()  # top-level fields SGLang does not know (and ignores); logged at debug level
    prompt_token_ids: bool = False  # ``return_prompt_token_ids``: every answer and chunk carries the prompt's ids


def _per_item(value: Any, count: int, name: str) -> list[Any]:
    if isinstance(value, list):
        if len(value) != count:
            raise BadRequestError(f"{name} has {len(value)} entries; the batch has {count} items")
        return value
    return [value] * count


def bootstrap_list(body: dict[str, Any], mode: str, count: int) -> list[Bootstrap | None]:
    """Bootstrap fields per item: a batch (or ``n`` > 1) carries a list of rooms, one per item."""
    if mode == "null":
        return [None] * count
    room = body.get("bootstrap_room")
    if count > 1 and not isinstance(room, list):
        raise BadRequestError(f"bootstrap_room must be a list of {count} rooms for a batch of {count} items")
    rooms = _per_item(room, count, "bootstrap_room")
    hosts = _per_item(body.get("bootstrap_host"), count, "bootstrap_host")
    ports = _per_item(body.get("bootstrap_port"), count, "bootstrap_port")
    items = [
        bootstrap_fields({"bootstrap_host": h, "bootstrap_port": p, "bootstrap_room": r}, mode)
        for h, p, r in zip(hosts, ports, rooms, strict=True)
    ]
    if len({b.room for b in items if b is not None}) != count:
        raise BadRequestError("bootstrap_room entries must be distinct, one per item")
    return items


def item_rids(rid: Any, count: int) -> list[str]:
    if isinstance(rid, list):
        return [str(r) for r in _per_item(rid, count, "rid")]
    if rid is None:
        return [uuid.uuid4().hex for _ in range(count)]
    return [str(rid)] if count == 1 else [f"{rid}-{i}" for i in range(count)]


def _samples(params: model.SamplingParams, n: Any) -> list[model.SamplingParams]:
    if isinstance(n, bool) or not isinstance(n, int) or not 1 <= n <= 128:
        raise BadRequestError(f"n must be an integer in [1, 128], got {n!r}")
    return [model.replace_sample(params, i) for i in range(n)]


def _nested(input_ids: Any) -> bool:
    return isinstance(input_ids, list) and bool(input_ids) and isinstance(input_ids[0], list)


def routed_dp_rank(body: dict[str, Any]) -> int | None:
    """``routed_dp_rank``, or its deprecated alias ``data_parallel_rank`` (SGLang 0.5.23 ``io_struct``
    ``GenerateReqInput.__post_init__``, ``protocol.py``): an integer, else None."""
    rank = body.get("routed_dp_rank")
    rank = body.get("data_parallel_rank") if rank is None else rank
    if rank is None:
        return None
    if isinstance(rank, bool) or not isinstance(rank, int):
        raise BadRequestError(f"routed_dp_rank must be an integer, got {rank!r}")
    return rank


def logprob_requests(body: dict[str, Any], count: int) -> list[int | None]:
    """Per prompt: None without ``return_logprob``, else ``top_logprobs_num`` (0 when absent). Both may be lists,
    one entry per prompt (``GenerateReqInput.normalize_batch_and_arguments``)."""
    wanted = _per_item(body.get("return_logprob"), count, "return_logprob")
    tops = _per_item(body.get("top_logprobs_num"), count, "top_logprobs_num")
    return [max(0, int(top or 0)) if want else None for want, top in zip(wanted, tops, strict=True)]


def parse_generate(body: Any, *, mode: str, context_length: int) -> ParsedRequest:
    if not isinstance(body, dict):
        raise BadRequestError("Request body must be a JSON object")
    contract.check_generate(body)  # raises ContractError: 400 {"error": "<text>"} (other errors: {"error": {...}})
    text, input_ids = body.get("text"), body.get("input_ids")
    batch = isinstance(text, list) or (
        isinstance(input_ids, list) and bool(input_ids) and isinstance(input_ids[0], list)
    )
    if batch:
        if text is not None and input_ids is not None:
            raise BadRequestError("Either text or input_ids should be provided, not both.")
        prompts_raw = text if text is not None else input_ids
        if not prompts_raw:
            raise BadRequestError("The batch is empty.")
        prompts = [prompt_tokens(t, None) if text is not None else prompt_tokens(None, t) for t in prompts_raw]
    else:
        prompts = [prompt_tokens(text, input_ids)]
    raw_params = _per_item(body.get("sampling_params"), len(prompts), "sampling_params")
    logprobs = logprob_requests(body, len(prompts))
    expanded: list[tuple[model.Tokens, model.SamplingParams, int | None]] = []
    for prompt, raw, top in zip(prompts, raw_params, logprobs, strict=True):
        params = sampling_params(raw, context_length=context_length, prompt_len=len(prompt.ids), default_max=128)
        n = raw.get("n", 1) if isinstance(raw, dict) else 1
        expanded += [(prompt, p, top) for p in _samples(params, n)]
    count = len(expanded)
    rooms = bootstrap_list(body, mode, count)
    rids = item_rids(body.get("rid"), count)
    stream = bool(body.get("stream", False))
    rank = routed_dp_rank(body)
    text_in_logprobs = body.get("return_text_in_logprobs") is True
    items = [
        GenerateInput(rid, prompt, params, stream, room, rank, top, text_in_logprobs)
        for rid, (prompt, params, top), room in zip(rids, expanded, rooms, strict=True)
    ]
    ignored = ignored_fields(body, GENERATE_FIELDS)
    return ParsedRequest(items, batch or count > 1, stream, ignored, body.get("return_prompt_token_ids") is True)
