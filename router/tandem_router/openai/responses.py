"""Worker responses made to conform to OpenAI's response schemas. Pure.

SGLang 0.5.23's OpenAI responses differ from OpenAI's schemas in a few nulls (``sglang/srt/entrypoints/openai/
protocol.py``): ``UsageInfo`` sends ``prompt_tokens_details: null`` and ``completion_tokens_details: null`` where
OpenAI's ``CompletionUsage`` has objects, streamed ``DeltaMessage`` sends ``tool_calls: null`` where OpenAI has an
array, completion chunks send ``usage: null``, and ``ChatMessage`` has no ``refusal``, which OpenAI's
``ChatCompletionResponseMessage`` requires (nullable). The router drops those nulls (an absent optional field means
the same) and adds ``refusal: null``; every other byte of the worker's answer is relayed as it came.
"""

from __future__ import annotations

import re
from typing import Any

import orjson

from tandem_router.openai.schema import Route

_EVENT_END = b"\n\n"
_DATA = b"data: "
# Stream chunks come from pydantic's ``model_dump_json()`` (compact): the usual null is cut as bytes, and an event
# is parsed only when a null OpenAI does not allow is still in it (another spelling, or the final usage chunk).
_COMPACT_NULLS = {Route.CHAT: b',"tool_calls":null', Route.COMPLETIONS: b',"usage":null'}
_STREAM_NULLS = {
    Route.CHAT: re.compile(rb'"(?:tool_calls|prompt_tokens_details|completion_tokens_details)"\s*:\s*null'),
    Route.COMPLETIONS: re.compile(rb'"(?:usage|prompt_tokens_details|completion_tokens_details)"\s*:\s*null'),
}


def _drop_nulls(doc: dict[str, Any], *keys: str) -> bool:
    dropped = False
    for key in keys:
        if key in doc and doc[key] is None:
            del doc[key]
            dropped = True
    return dropped


def conform(route: Route, doc: Any, *, stream: bool) -> Any:
    """One response object (or stream chunk) of ``route``, as OpenAI's schema has it (changed in place)."""
    if isinstance(doc, dict):
        conformed(route, doc, stream=stream)
    return doc


def conformed(route: Route, doc: dict[str, Any], *, stream: bool) -> bool:
    """Make ``doc`` conform in place; True when that changed it."""
    changed = False
    usage = doc.get("usage")
    if isinstance(usage, dict):
        changed = _drop_nulls(usage, "prompt_tokens_details", "completion_tokens_details")
    elif route is Route.COMPLETIONS:
        changed = _drop_nulls(doc, "usage")
    choices = doc.get("choices")
    if route is Route.CHAT and isinstance(choices, list):
        for choice in choices:
            message = choice.get("delta" if stream else "message") if isinstance(choice, dict) else None
            if isinstance(message, dict):
                changed = _drop_nulls(message, "tool_calls") or changed
                if not stream and "refusal" not in message:
                    message["refusal"] = None
                    changed = True
    return changed


def conform_body(route: Route, body: bytes) -> bytes:
    """A non-streamed response body."""
    if route is Route.GENERATE:
        return body
    try:
        doc = orjson.loads(body)
    except orjson.JSONDecodeError:
        return body
    return orjson.dumps(conform(route, doc, stream=False))


class EventSplitter:
    """Whole SSE events out of chunks that may split an event anywhere: a partial event is held until its end."""

    def __init__(self) -> None:
        self.tail = b""

    def feed(self, chunk: bytes) -> list[bytes]:
        data = self.tail + chunk
        end = data.rfind(_EVENT_END)
        if end < 0:
            self.tail = data
            return []
        self.tail = data[end + len(_EVENT_END) :]
        return data[:end].split(_EVENT_END)


class StreamConformer:
    """Re-frames a relayed SSE stream into whole events and conforms each ``data:`` JSON event.

    Chunks from the worker may split an event anywhere: a partial event is held until its end arrives.
    """

    def __init__(self, route: Route) -> None:
        if route is Route.GENERATE:
            raise ValueError("/generate streams are SGLang's own shape: relay them as they come")
        self.route = route
        self._events = EventSplitter()

    def feed(self, chunk: bytes) -> bytes:
        if not self._events.tail and chunk.find(_EVENT_END) == len(chunk) - 2:  # the usual chunk: exactly one event
            return self._event(chunk[:-2]) + _EVENT_END
        return b"".join(self._event(e) + _EVENT_END for e in self._events.feed(chunk))

    def flush(self) -> bytes:
        """What is left when the stream ends (an unterminated event, relayed as it came)."""
        tail, self._events.tail = self._events.tail, b""
        return tail

    def _event(self, event: bytes) -> bytes:
        if not event.startswith(_DATA) or event == b"data: [DONE]":
            return event
        event = event.replace(_COMPACT_NULLS[self.route], b"")
        if _STREAM_NULLS[self.route].search(event) is None:
            return event
        try:
            doc = orjson.loads(event[len(_DATA) :])
        except orjson.JSONDecodeError:
            return event
        return _DATA + orjson.dumps(conform(self.route, doc, stream=True))
