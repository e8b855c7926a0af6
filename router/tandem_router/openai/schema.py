"""Request models, the per-route table and OpenAI error bodies: the router's API contract, with no I/O.

The models validate what the router must understand (model name, messages, prompt, stream flag, ``n``) and
*allow* every other field, so tool calls, reasoning options and SGLang sampling parameters pass through to the
workers untouched. Handlers forward the client's own JSON object, never a re-dump of these models.
"""

from __future__ import annotations

from dataclasses import dataclass
from enum import StrEnum
from typing import Annotated, Any, Literal

from pydantic import BaseModel, ConfigDict, Field, StrictBool, StrictInt, StrictStr

MAX_N = 128


class Route(StrEnum):
    CHAT = "/v1/chat/completions"
    COMPLETIONS = "/v1/completions"
    GENERATE = "/generate"


class _Passthrough(BaseModel):
    model_config = ConfigDict(extra="allow", frozen=True)


class ChatMessage(_Passthrough):
    role: StrictStr = Field(min_length=1, description="system, user, assistant, tool, developer, ...")
    content: StrictStr | list[dict[str, Any]] | None = None


class StreamOptions(_Passthrough):
    include_usage: StrictBool | None = None


class ChatCompletionRequest(_Passthrough):
    """``POST /v1/chat/completions`` (OpenAI). Unknown fields are forwarded as sent."""

    model: StrictStr = Field(min_length=1)
    messages: list[ChatMessage] = Field(min_length=1)
    stream: StrictBool = False
    stream_options: StreamOptions | None = None
    n: Annotated[StrictInt, Field(ge=1, le=MAX_N)] = 1
    max_tokens: Annotated[StrictInt, Field(ge=0)] | None = None
    max_completion_tokens: Annotated[StrictInt, Field(ge=0)] | None = None
    temperature: float | None = Field(default=None, ge=0, le=2)
    tools: list[dict[str, Any]] | None = None


Prompt = StrictStr | list[StrictStr] | list[StrictInt] | list[list[StrictInt]]


class CompletionRequest(_Passthrough):
    """``POST /v1/completions`` (OpenAI). A list of prompts is a batch."""

    model: StrictStr = Field(min_length=1)
    prompt: Prompt
    stream: StrictBool = False
    stream_options: StreamOptions | None = None
    n: Annotated[StrictInt, Field(ge=1, le=MAX_N)] = 1
    max_tokens: Annotated[StrictInt, Field(ge=0)] | None = None
    temperature: float | None = Field(default=None, ge=0, le=2)


class GenerateRequest(_Passthrough):
    """``POST /generate`` (SGLang native). ``text`` or ``input_ids``; a list of either is a batch."""

    text: StrictStr | list[StrictStr] | None = None
    input_ids: list[StrictInt] | list[list[StrictInt]] | None = None
    model: StrictStr | None = None
    stream: StrictBool = False
    sampling_params: dict[str, Any] | list[dict[str, Any]] | None = None
    rid: StrictStr | list[StrictStr] | None = None


@dataclass(frozen=True)
class RouteFields:
    """What the router reads of one route's request body: the model it validates (unknown fields forwarded), the
    integer fields OpenAI's server also takes as whole floats (``requests.canonical``), and where the output-token
    limit is, most binding first (flow control's estimate, stream resume, naming a worker's context-length error)."""

    model: type[_Passthrough]
    integers: tuple[str, ...]
    output_limits: tuple[str, ...]


# The one table of per-route fields. A chat request's max_completion_tokens binds before its deprecated max_tokens;
# /generate's limit is sampling_params.max_new_tokens.
ROUTES: dict[Route, RouteFields] = {
    Route.CHAT: RouteFields(
        ChatCompletionRequest,
        ("n", "max_tokens", "max_completion_tokens", "seed", "top_logprobs"),
        ("max_completion_tokens", "max_tokens"),
    ),
    Route.COMPLETIONS: RouteFields(
        CompletionRequest, ("n", "max_tokens", "seed", "logprobs", "best_of"), ("max_tokens",)
    ),
    Route.GENERATE: RouteFields(GenerateRequest, (), ("max_new_tokens",)),
}


class ErrorDetail(BaseModel):
    message: str
    type: str
    param: str | None = None
    code: str | None = None  # OpenAI's schema: a string or null, never the HTTP status


class ErrorResponse(BaseModel):
    """OpenAI's error body: ``{"error": {"message", "type", "param", "code"}}``."""

    error: ErrorDetail


class ModelCard(BaseModel):
    id: str
    object: Literal["model"] = "model"
    created: int = 0
    owned_by: str = "tandem"


class ModelList(BaseModel):
    object: Literal["list"] = "list"
    data: list[ModelCard]


class ErrorType(StrEnum):
    INVALID_REQUEST = "invalid_request_error"
    AUTHENTICATION = "authentication_error"
    PERMISSION = "permission_error"
    NOT_FOUND = "not_found_error"
    RATE_LIMIT = "rate_limit_exceeded"
    SERVER = "server_error"
    UNAVAILABLE = "service_unavailable"


def error_body(message: str, type_: ErrorType, *, code: str | None = None, param: str | None = None) -> bytes:
    """The JSON bytes of an OpenAI error."""
    return (
        ErrorResponse(error=ErrorDetail(message=message, type=type_.value, param=param, code=code))
        .model_dump_json(exclude_none=False)
        .encode()
    )


def stream_error_event(message: str) -> bytes:
    """An SSE event carrying an OpenAI error; the ``openai`` SDK raises ``APIError`` when it reads one."""
    detail = ErrorDetail(message=message, type=ErrorType.SERVER.value)
    return b"data: " + ErrorResponse(error=detail).model_dump_json().encode() + b"\n\n"


def item_count(route: Route, body: dict[str, Any]) -> int:
    """How many sequences one request asks for: batch size x ``n``. Each needs its own bootstrap room.

    Returns 0 for a request that is not a batch (a single sequence whose room is a plain integer).
    """
    return items_of(batch_size(route, body), choices(route, body))


def items_of(batch: int | None, n: int) -> int:
    """``item_count`` from the batch size (None: not a batch) and the choices per prompt."""
    if batch is None:
        return 0 if n == 1 else n
    return batch * n


def choices(route: Route, body: dict[str, Any]) -> int:
    """Choices per prompt: OpenAI's ``n`` (validated), /generate's ``sampling_params.n`` (1 unless an integer >= 1)."""
    if route is not Route.GENERATE:
        n: int = body.get("n", 1)
        return n
    params = body.get("sampling_params")
    if isinstance(params, dict):
        n = params.get("n", 1)
        return n if isinstance(n, int) and n >= 1 else 1
    return 1


def batch_size(route: Route, body: dict[str, Any]) -> int | None:
    """Prompts in a batch; None: not a batch."""
    if route is Route.CHAT:
        return None
    if route is Route.COMPLETIONS:
        prompt = body.get("prompt")
        if isinstance(prompt, list) and prompt and isinstance(prompt[0], (str, list)):
            return len(prompt)
        return None
    text = body.get("text")
    if isinstance(text, list):
        return len(text)
    ids = body.get("input_ids")
    if isinstance(ids, list) and ids and isinstance(ids[0], list):
        return len(ids)
    return None


def prompt_text(route: Route, body: dict[str, Any], limit: int = 1024) -> str:
    """The first ``limit`` characters of the prompt, as text: the key of cache-aware (prefix) routing."""
    if route is Route.CHAT:
        parts: list[str] = []
        size = 0
        for message in body.get("messages", ()):
            content = message.get("content") if isinstance(message, dict) else None
            piece = content if isinstance(content, str) else str(content)
            parts.append(piece)
            size += len(piece)
            if size >= limit:
                break
        return "\n".join(parts)[:limit]
    value = body.get("prompt") if route is Route.COMPLETIONS else body.get("text", body.get("input_ids"))
    if isinstance(value, list) and value and isinstance(value[0], (str, list)):
        value = value[0]
    return (value if isinstance(value, str) else str(value))[:limit]


def routing_key(route: Route, body: dict[str, Any], text: str, limit: int) -> str | tuple[int, ...]:
    """The key of cache-aware prefill choice: the prompt's first ``limit`` token ids when the request carries ids
    (``/generate`` ``input_ids``, a completions prompt of ids; a batch: its first item), else the first ``limit``
    characters of ``text`` (the prompt as ``prompt_text`` gives it)."""
    ids = {Route.GENERATE: body.get("input_ids"), Route.COMPLETIONS: body.get("prompt")}.get(route)
    if isinstance(ids, list) and ids and isinstance(ids[0], list):
        ids = ids[0]
    if isinstance(ids, list) and ids and all(isinstance(t, int) for t in ids[:limit]):
        return tuple(ids[:limit])
    return text[:limit]
