"""A worker's 4xx as an OpenAI error: ``{"error": {"message", "type", "param", "code"}}``. Pure.

SGLang 0.5.23 answers a bad request in several shapes: the OpenAI routes' flat ``ErrorResponse``
(``{"object": "error", "message", "type": "BadRequestError", "param": null, "code": 400}``,
``OpenAIServingBase.create_error_response``), the same nested under ``"error"`` in a stream
(``create_streaming_error_response``), FastAPI's validation errors re-shaped by ``http_server.
validation_exception_handler`` (the message carries the pydantic ``loc``), and ``/generate``'s
``{"error": {"message"}}``. The client gets the worker's own message, the same status, and the parameter it names
when the worker says or the message shows it.
"""

from __future__ import annotations

import re
from typing import Any

import orjson

from tandem_router.openai.schema import ROUTES, ErrorType, Route, error_body

_TYPES = {
    401: ErrorType.AUTHENTICATION,
    403: ErrorType.PERMISSION,
    404: ErrorType.NOT_FOUND,
    429: ErrorType.RATE_LIMIT,
}
# pydantic's location in a FastAPI validation message: "'loc': ('body', 'top_logprobs')".
_LOC = re.compile(r"'loc': \('body', '([^']+)'")
_LEADING_NAME = re.compile(r"[A-Za-z_][A-Za-z0-9_]*")
_PROMPT_NAMES = frozenset({"input_ids", "text", "input"})
MAX_MESSAGE_CHARS = 2000


def error_type(status: int) -> ErrorType:
    """OpenAI's error ``type`` for a status."""
    if status >= 500:
        return ErrorType.SERVER
    return _TYPES.get(status, ErrorType.INVALID_REQUEST)


def worker_message(raw: bytes) -> tuple[str, str | None]:
    """The message and the ``param`` (when it states one) of a worker's error body, whatever its shape."""
    try:
        doc: Any = orjson.loads(raw)
    except orjson.JSONDecodeError:
        return raw.decode(errors="replace").strip(), None
    if isinstance(doc, dict) and isinstance(doc.get("error"), dict):
        doc = doc["error"]
    if isinstance(doc, dict):
        for key in ("message", "error", "detail"):
            if isinstance(doc.get(key), str):
                param = doc.get("param")
                return doc[key], param if isinstance(param, str) and param else None
        return orjson.dumps(doc).decode(), None
    return str(doc), None


def param_named(message: str, body: dict[str, Any]) -> str | None:
    """The request field a worker's message is about: pydantic's ``loc``; for the context-length checks of
    ``TokenizerManager._validate_one_request``, the output limit (or the prompt when it alone is too long); or the
    field the message starts with (SGLang's sampling checks: ``"top_p must be in (0, 1], got 0.0."``,
    ``"Prompt cannot be empty"``)."""
    loc = _LOC.search(message)
    if loc is not None:
        return loc.group(1)
    prompt = next((p for p in ("prompt", "messages") if p in body), None)
    if "maximum context length" in message:
        return next((p for p in ROUTES[Route.CHAT].output_limits if p in body), prompt)  # both OpenAI routes' names
    if "longer than the model's context length" in message:
        return prompt
    lead = _LEADING_NAME.match(message)
    if lead is None:
        return None
    name = lead.group(0).lower()
    if name in _PROMPT_NAMES:  # SGLang's internal names of what the client sent as the prompt
        return prompt
    return {k.lower(): k for k in body}.get(name)


def client_error_body(status: int, raw: bytes, body: dict[str, Any]) -> bytes:
    """The OpenAI error the client gets for a worker's ``status`` (4xx) answer ``raw`` to request ``body``."""
    message, param = worker_message(raw)
    message = message[:MAX_MESSAGE_CHARS] or f"the worker rejected the request (HTTP {status})"
    return error_body(message, error_type(status), param=param or param_named(message, body))


def stream_error_status(event: bytes) -> int | None:
    """The HTTP status an SSE error event (``data: {"error": {...}}``) reports in its ``code``, if it has one."""
    try:
        doc = orjson.loads(event.split(b"\n\n", 1)[0].removeprefix(b"data: "))
    except orjson.JSONDecodeError:
        return None
    error = doc.get("error") if isinstance(doc, dict) else None
    code = error.get("code") if isinstance(error, dict) else None
    return code if isinstance(code, int) and not isinstance(code, bool) and 400 <= code <= 599 else None
