"""OpenAI wire compatibility, pure (issue 19 items 3 and 4): requests made canonical, worker errors turned into
OpenAI errors, SGLang's responses made to conform to OpenAI's schemas (checked against the official document)."""

from __future__ import annotations

from typing import Any

import orjson
import pytest

from tandem_router.openai import errors, requests, responses
from tandem_router.openai.schema import Route
from tests.router.openai_spec import violations


def test_null_means_absent_and_whole_floats_are_integers() -> None:
    body = {"model": "m", "prompt": "p", "n": 2.0, "max_tokens": 8.0, "seed": 8811.0, "logprobs": 3.0,
            "temperature": 1.0, "stream": None, "stop": None, "top_p": 0.5}  # fmt: skip
    got = requests.canonical(Route.COMPLETIONS, body)
    assert got == {"model": "m", "prompt": "p", "n": 2, "max_tokens": 8, "seed": 8811, "logprobs": 3,
                   "temperature": 1.0, "top_p": 0.5}  # fmt: skip
    assert type(got["temperature"]) is float  # a float field stays a float
    assert requests.canonical(Route.CHAT, {"n": 2.5})["n"] == 2.5  # not whole: the model refuses it by name
    assert requests.canonical(Route.CHAT, {"max_tokens": 8.5e20})["max_tokens"] == 8.5e20  # beyond 64 bits: refused
    assert requests.canonical(Route.GENERATE, {"text": None}) == {"text": None}  # SGLang's own API: as sent


@pytest.mark.parametrize(
    ("body", "param"),
    [
        ({"prompt": ""}, "prompt"),
        ({"prompt": [[]]}, "prompt"),
        ({"prompt": ["a", ""]}, "prompt"),
        ({"prompt": [5, -1]}, "prompt"),
        ({"prompt": [[5], [-1]]}, "prompt"),
        ({"prompt": "a", "best_of": 3, "n": 2}, "best_of"),
        ({"prompt": "a", "best_of": 2, "n": 2}, None),
        ({"prompt": [[1, 2], [3]]}, None),
        ({"prompt": "a", "seed": 2.5}, "seed"),
        ({"prompt": "a", "logprobs": True}, "logprobs"),
    ],
)
def test_completions_refusals_name_the_parameter(body: dict[str, Any], param: str | None) -> None:
    refusal = requests.refusal(Route.COMPLETIONS, {"model": "m", **body})
    assert (refusal.param if refusal else None) == param


def test_pydantic_locations_as_openai_parameter_paths() -> None:
    assert requests.param_path(("messages", 0, "role")) == "messages[0].role"
    assert requests.param_path(("prompt", "str")) == "prompt"
    assert requests.param_path(("prompt", "list[int]", 3)) == "prompt"
    assert requests.param_path(()) is None


SGLANG_400 = b'{"object":"error","message":"top_p must be in (0, 1], got 0.0.","type":"BadRequestError","param":null}'
TOO_LONG = "Requested token count exceeds the model's maximum context length of 8 tokens."
PROMPT_TOO_LONG = "The input (9 tokens) is longer than the model's context length (8 tokens)."


@pytest.mark.parametrize(
    ("raw", "body", "message", "param"),
    [
        (SGLANG_400, {"top_p": 0}, "top_p must be in (0, 1], got 0.0.", "top_p"),
        (b'{"error":{"message":"Prompt cannot be empty"}}', {"prompt": ""}, "Prompt cannot be empty", "prompt"),
        (b'{"error":"input_ids must be token ids"}', {"prompt": [9]}, "input_ids must be token ids", "prompt"),
        (b'{"object":"error","message":"x","param":"tools","code":400}', {}, "x", "tools"),
        (b'{"detail":"Not Found"}', {}, "Not Found", None),
        (b"plain text", {"plain": 1}, "plain text", "plain"),
        (TOO_LONG.encode(), {"max_tokens": 9, "prompt": "p"}, TOO_LONG, "max_tokens"),
        (PROMPT_TOO_LONG.encode(), {"messages": []}, PROMPT_TOO_LONG, "messages"),
    ],
)
def test_worker_error_bodies_become_openai_errors(
    raw: bytes, body: dict[str, Any], message: str, param: str | None
) -> None:
    doc = orjson.loads(errors.client_error_body(400, raw, body))
    assert violations("ErrorResponse", doc) == []
    assert doc["error"] == {"message": message, "type": "invalid_request_error", "param": param, "code": None}


def test_stream_error_status() -> None:
    assert errors.stream_error_status(b'data: {"error": {"code": 400, "message": "x"}}\n\n') == 400
    assert errors.stream_error_status(b'data: {"error": {"code": "oops"}}\n\n') is None
    assert errors.stream_error_status(b"data: {nope\n\n") is None


# SGLang 0.5.23's shapes (protocol.py: ChatCompletionResponse, UsageInfo, DeltaMessage, CompletionStreamResponse).
_USAGE = {"prompt_tokens": 3, "total_tokens": 5, "completion_tokens": 2, "prompt_tokens_details": None,
          "reasoning_tokens": 0, "completion_tokens_details": None}  # fmt: skip
SGLANG_CHAT = {"id": "c", "object": "chat.completion", "created": 1, "model": "m", "usage": _USAGE,
               "choices": [{"index": 0, "message": {"role": "assistant", "content": "hi", "reasoning_content": None},
                            "logprobs": None, "finish_reason": "stop", "matched_stop": None}]}  # fmt: skip
SGLANG_CHAT_CHUNK = {"id": "c", "object": "chat.completion.chunk", "created": 1, "model": "m", "usage": None,
                     "choices": [{"index": 0, "delta": {"role": "assistant", "content": "hi", "reasoning_content": None,
                                  "tool_calls": None}, "logprobs": None, "finish_reason": "stop",
                                  "matched_stop": None}]}  # fmt: skip
SGLANG_COMPLETION_CHUNK = {"id": "c", "object": "text_completion", "created": 1, "model": "m", "usage": None,
                           "choices": [{"index": 0, "text": "hi", "logprobs": None, "finish_reason": "length",
                                        "matched_stop": None}]}  # fmt: skip


def test_sglang_responses_conform_to_openai_schemas() -> None:
    assert violations("CreateChatCompletionResponse", SGLANG_CHAT)  # as SGLang sends it: not OpenAI's shape
    chat = orjson.loads(responses.conform_body(Route.CHAT, orjson.dumps(SGLANG_CHAT)))
    assert violations("CreateChatCompletionResponse", chat) == []
    assert chat["choices"][0]["message"]["content"] == "hi"
    assert chat["choices"][0]["message"]["refusal"] is None
    assert violations("CreateChatCompletionStreamResponse", SGLANG_CHAT_CHUNK)
    assert violations("CreateCompletionResponse", SGLANG_COMPLETION_CHUNK)
    for route, chunk, schema in (
        (Route.CHAT, SGLANG_CHAT_CHUNK, "CreateChatCompletionStreamResponse"),
        (Route.COMPLETIONS, SGLANG_COMPLETION_CHUNK, "CreateCompletionResponse"),
    ):
        conformer = responses.StreamConformer(route)
        event = b"data: " + orjson.dumps(chunk) + b"\n\n"
        stream = event * 2 + b"data: [DONE]\n\n"
        split = b"".join(conformer.feed(stream[i : i + 7]) for i in range(0, len(stream), 7)) + conformer.flush()
        whole = conformer.feed(event) + conformer.feed(event + b"data: [DONE]\n\n")  # one event a chunk, or two
        assert split == whole
        events = split.split(b"\n\n")
        assert events[-2:] == [b"data: [DONE]", b""]
        for e in events[:-2]:
            assert violations(schema, orjson.loads(e.removeprefix(b"data: "))) == []
    spaced = b'data: {"choices": [{"delta": {"tool_calls": null}}], "usage": {"prompt_tokens_details": null}}\n\n'
    assert responses.StreamConformer(Route.CHAT).feed(spaced) == b'data: {"choices":[{"delta":{}}],"usage":{}}\n\n'
    assert responses.conform_body(Route.GENERATE, b'{"text": null}') == b'{"text": null}'
    assert responses.conform_body(Route.CHAT, b"not json") == b"not json"
