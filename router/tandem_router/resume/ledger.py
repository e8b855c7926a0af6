"""What a resumable stream relayed to its client, and the shape of the stream it continues in. Pure.

A ``StreamLedger`` sits on the relay path of one stream: ``feed`` turns the worker's bytes into the bytes the
client sees (whole SSE events; after a resume, the new stream rewritten into the old one) and records what was
sent. When the pair fails, ``refusal`` says whether the stream can go on from there and ``continuation`` is the
request that does. The route-specific parts are in ``openai_streams`` (chat, completions) and ``generate``.
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import orjson

from tandem_router.openai.requests import ParsedRequest
from tandem_router.openai.responses import EventSplitter

_EVENT_END = b"\n\n"
_DATA = b"data: "
_DONE = b"data: [DONE]"


@dataclass(frozen=True)
class Refusal:
    """Why a stream is not resumed: ``code`` is the metric label, ``why`` the sentence the client and logs get."""

    code: str
    why: str


FINISHED = Refusal("finished", "the stream had already finished")
NO_TOKENS_LEFT = Refusal("no_tokens_left", "no output tokens were left to generate")
NOT_COUNTED = Refusal("no_usage", "the worker reported no token counts, so the output limit cannot be shrunk")


class StreamLedger(ABC):
    """One resumable stream as its client saw it."""

    def __init__(self, request: ParsedRequest) -> None:
        self.request = request  # the client's request: its facts (the output limit) ...
        self.body = request.body  # ... and its body, which the continuations are made from
        self.segment = 0  # 0: the first pair's stream; n: after the n-th resume
        self.finished = False  # the end of the answer (a finish reason or [DONE]) was relayed
        self.sent_tokens = 0  # output tokens relayed so far
        self._base_tokens = 0  # output tokens relayed before the current segment
        self._events = EventSplitter()
        self.on_event: Callable[[dict[str, Any]], None] | None = None  # sees each JSON event the client gets
        # Makes each JSON event conform to the route's schema (in place; True: it changed it). The relay sets it,
        # so that an event is parsed once for the ledger, the integrity texts and the conformance together.
        self.conform: Callable[[dict[str, Any]], bool] | None = None
        self._edited = False  # ``_shape`` changed the event being shaped

    @property
    def refusal(self) -> Refusal | None:
        """Why the stream cannot go on from what was relayed; None: it can."""
        if self.finished:
            return FINISHED
        if self._remaining_tokens() == 0:
            return NO_TOKENS_LEFT
        return self._refusal()

    @property
    def can_resume(self) -> bool:
        return self.refusal is None

    def feed(self, chunk: bytes) -> bytes:
        """Whole events of the worker's stream, as the client sees them (a partial event is held back)."""
        if not self._events.tail and chunk.find(_EVENT_END) == len(chunk) - 2:  # the usual chunk: one whole event
            event = self._event(chunk[:-2])
            return event + _EVENT_END if event else b""
        out = [self._event(event) for event in self._events.feed(chunk)]
        return b"".join(e + _EVENT_END for e in out if e)

    def next_segment(self) -> None:
        """The current pair failed: what it sent in part of an event is dropped, the next pair's stream follows."""
        self._events = EventSplitter()
        self._base_tokens = self.sent_tokens
        self.segment += 1

    def _event(self, event: bytes) -> bytes:
        if not event.startswith(_DATA):
            return event
        if event == _DONE:
            self.finished = True
            return event
        try:
            doc = orjson.loads(memoryview(event)[len(_DATA) :])  # no copy of the event's JSON
        except orjson.JSONDecodeError:
            return event
        if not isinstance(doc, dict) or "error" in doc:
            return event
        self._edited = False
        if not self._shape(doc):
            return b""
        if self.on_event is not None:
            self.on_event(doc)
        conformed = self.conform is not None and self.conform(doc)
        return _DATA + orjson.dumps(doc) if self._edited or conformed else event  # unchanged: the worker's bytes

    @abstractmethod
    def upstream(self) -> dict[str, Any]:
        """The client's request as sent to the first pair (asking the worker for what the ledger needs)."""

    @abstractmethod
    def continuation(self) -> dict[str, Any]:
        """The request that goes on from what the client received (as sent to the workers)."""

    @abstractmethod
    def _shape(self, doc: dict[str, Any]) -> bool:
        """Record and rewrite one event's JSON in place (setting ``_edited`` when it changes it); False: the
        client does not see it."""

    @abstractmethod
    def _remaining_tokens(self) -> int | None:
        """Output tokens still allowed (None: no limit given)."""

    def _refusal(self) -> Refusal | None:
        return None


def shrink(params: dict[str, Any], limit_keys: tuple[str, ...], min_key: str, sent: int) -> None:
    """Output limits of a continuation: each limit and the minimum less the tokens already sent."""
    for key in limit_keys:
        if isinstance(params.get(key), int):
            params[key] = max(params[key] - sent, 1)
    if isinstance(params.get(min_key), int):
        params[min_key] = max(params[min_key] - sent, 0)
