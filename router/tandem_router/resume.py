"""Resuming a chat stream on a fresh pair after the client got tokens: what was relayed, and how to go on. Pure.

The router relays a resumable stream through a ``StreamLedger``, which keeps the text and the completion-token
count the client has received. When the pair fails mid-stream, ``continuation`` builds the request that goes on
from there, as SGLang 0.5.23 supports it: the relayed text as a final assistant message with
``continue_final_message`` (``serving_chat._handle_last_assistant_message`` drops that message and
``_append_assistant_prefix_to_prompt_ids`` appends its tokens after the generation prompt), so the model sees the
prompt followed by what it already said; ``max_tokens``/``min_tokens`` shrink by the tokens already sent, and the
seed and every other sampling field stay. The ledger then shapes the new stream into the old one: the first
stream's ``id`` and ``created``, no second ``role`` delta, usage counted over the whole answer.

Token counts come from SGLang's ``continuous_usage_stats`` (every chunk carries the usage so far): the router asks
the worker for them on a resumable stream and drops them again unless the client asked for them. Re-tokenizing the
relayed text is token-exact for the tokenizers this targets (the text decodes back to the same ids when tokens
are whole words or byte-level BPE pieces that the tokenizer would merge the same way); it is not guaranteed for
every tokenizer, which is why only temperature-0 or seeded streams are claimed to continue "as if nothing
happened".

Not resumable (a break ends with the error event, as before): ``n > 1``, tool calls, a stream that sent
reasoning content (the reasoning parser's markup is not in the relayed text), completions and ``/generate``.
"""

from __future__ import annotations

import copy
from dataclasses import dataclass, field
from typing import Any

import orjson

from tandem_router.openai.responses import EventSplitter
from tandem_router.schema import Route

_EVENT_END = b"\n\n"
_DATA = b"data: "


@dataclass(frozen=True)
class ResumeConfig:
    max_attempts: int = 2  # fresh pairs tried per stream after its first byte, all breaks together
    deadline_s: float = 30.0  # from the first break: past this no further pair is tried


def resumable(route: Route, body: dict[str, Any]) -> bool:
    """Whether a break after the first byte can be resumed (see the module docstring for what is excluded)."""
    if route is not Route.CHAT or body.get("stream") is not True:
        return False
    if body.get("n", 1) not in (1, None) or body.get("tools") or body.get("tool_choice") not in (None, "none"):
        return False
    messages = body.get("messages")
    return isinstance(messages, list) and bool(messages) and all(isinstance(m, dict) for m in messages)


def upstream_body(body: dict[str, Any]) -> dict[str, Any]:
    """The request as sent to the workers: the usage of every chunk asked for (the ledger counts tokens with it)."""
    options = body.get("stream_options")
    options = dict(options) if isinstance(options, dict) else {}
    return {**body, "stream_options": {**options, "include_usage": True, "continuous_usage_stats": True}}


@dataclass
class StreamLedger:
    """One resumable chat stream as the client saw it; ``feed`` shapes the worker's bytes into what it sees."""

    body: dict[str, Any]  # the client's request
    stream_id: str | None = None
    created: int | None = None
    prompt_tokens: int | None = None
    sent_tokens: int = 0  # completion tokens relayed so far
    finished: bool = False  # a finish_reason or [DONE] was relayed
    reasoning: bool = False  # reasoning content was relayed (not resumable)
    segment: int = 0  # 0: the first pair's stream; n: after the n-th resume
    _text: list[str] = field(default_factory=list)
    _base_tokens: int = 0  # completion tokens relayed before the current segment
    _events: EventSplitter = field(default_factory=EventSplitter)

    @property
    def text(self) -> str:
        return "".join(self._text)

    @property
    def can_resume(self) -> bool:
        """Not finished, no reasoning sent, tokens left, and the token count known (the worker reported usage)."""
        counted = self.prompt_tokens is not None or not self._text
        return counted and not self.finished and not self.reasoning and self._remaining_tokens() != 0

    def feed(self, chunk: bytes) -> bytes:
        """Whole events of the worker's stream, as the client sees them (a partial event is held back)."""
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
        if event == b"data: [DONE]":
            self.finished = True
            return event
        try:
            doc = orjson.loads(event[len(_DATA) :])
        except orjson.JSONDecodeError:
            return event
        if not isinstance(doc, dict) or "error" in doc:
            return event
        keep = self._shape(doc)
        return _DATA + orjson.dumps(doc) if keep else b""

    def _shape(self, doc: dict[str, Any]) -> bool:
        """Record and rewrite one chunk in place; False: the client does not see it."""
        if self.stream_id is None:
            self.stream_id, self.created = doc.get("id"), doc.get("created")
        else:
            doc["id"], doc["created"] = self.stream_id, self.created
        choices = doc.get("choices") or []
        visible = self._usage(doc, final=not choices)
        for choice in choices:
            delta = choice.get("delta") if isinstance(choice, dict) else None
            if not isinstance(delta, dict):
                continue
            if self.segment and delta.get("role") is not None:
                del delta["role"]
                if not delta.get("content") and not delta.get("tool_calls") and choice.get("finish_reason") is None:
                    visible = False  # the new stream's opening (role only): the client had it already
            if isinstance(delta.get("content"), str):
                self._text.append(delta["content"])
            if delta.get("reasoning_content"):
                self.reasoning = True
            if choice.get("finish_reason") is not None:
                self.finished = True
        return visible

    def _usage(self, doc: dict[str, Any], *, final: bool) -> bool:
        """Usage over the whole answer; the chunk's usage as the client asked for it. False: drop the chunk."""
        usage = doc.get("usage")
        if isinstance(usage, dict):
            if self.prompt_tokens is None:
                self.prompt_tokens = usage.get("prompt_tokens")
            completion = self._base_tokens + int(usage.get("completion_tokens") or 0)
            self.sent_tokens = completion
            prompt = self.prompt_tokens or 0
            doc["usage"] = {**usage, "prompt_tokens": prompt, "completion_tokens": completion}
            doc["usage"]["total_tokens"] = prompt + completion
        options = self.body.get("stream_options")
        options = options if isinstance(options, dict) else {}
        if final:
            return bool(options.get("include_usage"))
        if not options.get("continuous_usage_stats"):
            doc["usage"] = None
        return True

    def _remaining_tokens(self) -> int | None:
        limit = self.body.get("max_completion_tokens", self.body.get("max_tokens"))
        return None if not isinstance(limit, int) else max(limit - self.sent_tokens, 0)

    def continuation(self) -> dict[str, Any]:
        """The request that goes on from what the client received (as sent to the workers)."""
        body = copy.deepcopy(self.body)
        messages: list[dict[str, Any]] = body["messages"]
        text = self.text
        if text:
            last = messages[-1]
            if body.get("continue_final_message") is True and last.get("role") == "assistant":
                last["content"] = f"{last.get('content') or ''}{text}"
            else:
                messages.append({"role": "assistant", "content": text})
            body["continue_final_message"] = True
        for key in ("max_completion_tokens", "max_tokens", "min_tokens"):
            if isinstance(body.get(key), int):
                body[key] = max(body[key] - self.sent_tokens, 0 if key == "min_tokens" else 1)
        return upstream_body(body)
