"""Parse ``/v1/completions`` and ``/v1/chat/completions`` bodies (SGLang 0.5.23 OpenAI serving classes). Pure.

``n`` > 1 gives one item per choice (sampled independently when temperature > 0; in PD mode ``bootstrap_room`` is
a list, one room per choice, as a router sends it). A completions ``prompt`` may be a batch (a list of strings or
of token-id lists): items are prompt-major, ``n`` per prompt, as ``OpenAIServingCompletion`` numbers its choices;
``echo`` puts each prompt's text in front of its choices' text; ``suffix`` is accepted and, as in SGLang without a
completion template, unused; ``logprobs`` (completions: the number of top logprobs; chat: ``logprobs`` with
``top_logprobs``) asks for the output tokens' logprobs (``return_logprob``, ``top_logprobs_num``, with text), as
``OpenAIServingChat/Completion._convert_to_internal_request`` do.
Tool calling and reasoning fields are validated and passed through as SGLang does: ``tools``/``tool_choice`` with
``"required"`` or a named function make the answer a call of that function (SGLang constrains decoding to the
tool's schema); ``separate_reasoning`` and ``chat_template_kwargs`` are accepted (the simulated model emits no
reasoning section).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from tandem_sim.api.requests import (
    BadRequestError,
    GenerateInput,
    bootstrap_list,
    item_rids,
    prompt_tokens,
    routed_dp_rank,
    sampling_params,
)
from tandem_sim.api.sglang_fields import CHAT_FIELDS, COMPLETION_FIELDS, ignored_fields
from tandem_sim.model import model

_SAMPLING = (
    ("temperature", "temperature"),
    ("top_p", "top_p"),
    ("top_k", "top_k"),
    ("stop", "stop"),
    ("ignore_eos", "ignore_eos"),
    ("min_tokens", "min_new_tokens"),
    ("seed", "sampling_seed"),
)


@dataclass(frozen=True)
class OpenAIRequest:
    items: list[GenerateInput]  # one per choice
    stream: bool
    include_usage: bool
    continuous_usage: bool
    tool_call: str | None  # the function every choice calls (tool_choice "required" or named), else None
    ignored: tuple[str, ...] = ()  # top-level fields SGLang's request model does not know (and ignores)
    n: int = 1  # choices per prompt (items are prompt-major)
    echo: tuple[str, ...] = ()  # completions ``echo``: each item's prompt text, put before its text


def _openai_sampling(body: dict[str, Any]) -> dict[str, Any]:
    raw: dict[str, Any] = {}
    max_tokens = body.get("max_completion_tokens", body.get("max_tokens"))
    if max_tokens is not None:
        raw["max_new_tokens"] = max_tokens
    for src, dst in _SAMPLING:
        if body.get(src) is not None:
            raw[dst] = body[src]
    return raw


def _tool_call(body: dict[str, Any]) -> str | None:
    """Validate ``tools``/``tool_choice`` like SGLang's request model; the forced function name, if any."""
    tools = body.get("tools")
    names: list[str] = []
    if tools is not None:
        if not isinstance(tools, list):
            raise BadRequestError("tools: Input should be a valid list")
        for i, tool in enumerate(tools):
            function = tool.get("function") if isinstance(tool, dict) else None
            if not isinstance(function, dict) or not isinstance(function.get("name"), str):
                raise BadRequestError(f"tools[{i}].function.name: Field required")
            if tool.get("type", "function") != "function":
                raise BadRequestError(f"tools[{i}].type: Input should be 'function'")
            names.append(function["name"])
    choice = body.get("tool_choice")
    if choice is None or choice in ("none", "auto"):
        return None
    if not names:
        raise BadRequestError("tool_choice requires tools to be specified")
    if choice == "required":
        return names[0]
    if isinstance(choice, dict) and isinstance(choice.get("function"), dict):
        name = choice["function"].get("name")
        if name not in names:
            raise BadRequestError(f"Tool '{name}' not found in tools list.")
        return str(name)
    raise BadRequestError("tool_choice: must be 'none', 'auto', 'required' or {'type': 'function', 'function': {...}}")


def _check_pass_through(body: dict[str, Any], chat: bool) -> None:
    for name in ("separate_reasoning", "stream_reasoning", "parallel_tool_calls", "logprobs" if chat else "echo"):
        if body.get(name) is not None and not isinstance(body[name], bool):
            raise BadRequestError(f"{name}: Input should be a valid boolean")
    logprobs = body.get("logprobs")
    if not chat and logprobs is not None and (isinstance(logprobs, bool) or not isinstance(logprobs, int)):
        raise BadRequestError("logprobs: Input should be a valid integer")
    top = body.get("top_logprobs")
    if chat and top is not None and (isinstance(top, bool) or not isinstance(top, int)):
        raise BadRequestError("top_logprobs: Input should be a valid integer")
    for name in ("chat_template_kwargs", "stream_options", "response_format"):
        if body.get(name) is not None and not isinstance(body[name], dict):
            raise BadRequestError(f"{name}: Input should be a valid dictionary")


def _chat_prompt(messages: Any, continue_final: bool = False) -> model.Tokens:
    """The chat template over ``messages``. A last assistant message (``serving_chat.
    _handle_last_assistant_message``) is a prefix the answer continues when ``continue_final_message`` is set
    (its tokens follow the generation prompt, ``_append_assistant_prefix_to_prompt_ids``), else a user turn."""
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
    prefix = ""
    if turns[-1][0] == "assistant" and isinstance(messages[-1].get("content"), str):
        if continue_final and messages[-1]["content"]:
            prefix = turns.pop()[1]
        else:
            turns[-1] = ("user", turns[-1][1])
    return model.tokenize(
        f"{model.apply_chat_template(turns)} {prefix}" if prefix else model.apply_chat_template(turns)
    )


def _ends_with_assistant_text(messages: Any) -> bool:
    return bool(
        isinstance(messages, list)
        and messages
        and isinstance(messages[-1], dict)
        and messages[-1].get("role") == "assistant"
        and isinstance(messages[-1].get("content"), str)
        and messages[-1]["content"]
    )


def _completion_prompts(prompt: Any) -> list[tuple[model.Tokens, str]]:
    """Each prompt of a completions request (a batch when a list of strings or of token lists) and its echo text
    (``_get_echo_text``: the string itself, token ids decoded)."""
    if not prompt or (isinstance(prompt, list) and all(not p for p in prompt)):
        raise BadRequestError("Prompt cannot be empty")
    if isinstance(prompt, str) or (isinstance(prompt, list) and all(isinstance(t, int) for t in prompt)):
        prompt = [prompt]
    if not isinstance(prompt, list) or not all(isinstance(p, str | list) for p in prompt):
        raise BadRequestError("prompt: must be a string, a list of strings, token ids or lists of token ids")
    prompts = []
    for p in prompt:
        tokens = prompt_tokens(p, None) if isinstance(p, str) else prompt_tokens(None, p)
        prompts.append((tokens, p if isinstance(p, str) else " ".join(tokens.words)))
    return prompts


def _logprobs(body: dict[str, Any], chat: bool) -> int | None:
    """The top-logprobs count asked for, None without logprobs (chat: ``return_logprob=request.logprobs``,
    ``top_logprobs_num=request.top_logprobs or 0``; completions: ``return_logprob=request.logprobs is not None``,
    ``top_logprobs_num=request.logprobs``)."""
    if chat:
        return max(0, int(body.get("top_logprobs") or 0)) if body.get("logprobs") is True else None
    logprobs = body.get("logprobs")
    return None if logprobs is None else max(0, int(logprobs))


def parse_openai(body: Any, *, chat: bool, mode: str, context_length: int) -> OpenAIRequest:
    if not isinstance(body, dict):
        raise BadRequestError("Request body must be a JSON object")
    if "model" in body and not isinstance(body["model"], str):  # optional in SGLang (protocol.py: default name)
        raise BadRequestError("model: Input should be a valid string")
    _check_pass_through(body, chat)
    tool_call = _tool_call(body) if chat else None
    continues = chat and body.get("continue_final_message") is True and _ends_with_assistant_text(body["messages"])
    prompts = [(_chat_prompt(body.get("messages"), continues), "")] if chat else _completion_prompts(body.get("prompt"))
    n = body.get("n", 1)
    if isinstance(n, bool) or not isinstance(n, int) or not 1 <= n <= 128:
        raise BadRequestError(f"n must be an integer in [1, 128], got {n!r}")
    count = len(prompts) * n
    rooms = bootstrap_list(body, mode, count)
    rids = item_rids(body.get("rid"), count)
    stream = bool(body.get("stream", False))
    items = []
    rank = routed_dp_rank(body)
    top = _logprobs(body, chat)
    for p, (prompt, _) in enumerate(prompts):
        params = sampling_params(
            _openai_sampling(body),
            context_length=context_length,
            prompt_len=len(prompt.ids),
            default_max=context_length,
        )
        items += [
            GenerateInput(
                rids[p * n + i], prompt, model.replace_sample(params, i), stream, rooms[p * n + i], rank, top, True
            )
            for i in range(n)
        ]
    echo = tuple(text for _, text in prompts for _ in range(n)) if not chat and body.get("echo") else ()
    options = body.get("stream_options") or {}
    return OpenAIRequest(
        items,
        stream,
        include_usage=bool(options.get("include_usage")),
        continuous_usage=bool(options.get("continuous_usage_stats")),
        tool_call=tool_call,
        ignored=ignored_fields(body, CHAT_FIELDS if chat else COMPLETION_FIELDS),
        n=n,
        echo=echo,
    )
