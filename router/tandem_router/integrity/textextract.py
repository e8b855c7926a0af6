"""The generated text inside a relayed response, for the integrity detectors (pure).

Non-streaming bodies are parsed once. Streams are fed chunk by chunk as the router relays them (chunks need not
align with SSE events); ``/generate`` streams carry the cumulative text in every event (SGLang's default), the
OpenAI routes carry deltas.
"""

from __future__ import annotations

from typing import Any

import orjson

CHAT = "/v1/chat/completions"
COMPLETIONS = "/v1/completions"
GENERATE = "/generate"


def _choice_text(route: str, choice: dict[str, Any], *, delta: bool) -> str:
    if route == CHAT:
        msg = choice.get("delta" if delta else "message") or {}
        parts = [msg.get("reasoning_content"), msg.get("content")]
        return "".join(p for p in parts if isinstance(p, str))
    text = choice.get("text")
    return text if isinstance(text, str) else ""


def _texts(route: str, doc: Any, *, delta: bool) -> list[str]:
    """One text per choice / batch item, in order."""
    if route == GENERATE:
        items = doc if isinstance(doc, list) else [doc]
        return [item.get("text", "") if isinstance(item, dict) else "" for item in items]
    if not isinstance(doc, dict):
        return []
    choices = doc.get("choices") or []
    return [_choice_text(route, c, delta=delta) for c in choices if isinstance(c, dict)]


def doc_texts(route: str, doc: Any) -> list[str]:
    """Texts of a parsed complete (non-streaming) response."""
    return _texts(route, doc, delta=False)


def body_texts(route: str, body: bytes) -> list[str]:
    """Texts of a complete (non-streaming) response body; [] when it is not JSON."""
    try:
        return _texts(route, orjson.loads(body), delta=False)
    except orjson.JSONDecodeError:
        return []


class StreamTexts:
    """Accumulates the text of each choice/index from SSE chunks (``feed``), or from events another reader of the
    stream parsed already (``add``: the resume ledger parses every event anyway; parsing it twice would double
    the relay's cost)."""

    def __init__(self, route: str) -> None:
        self.route = route
        self._pending = b""
        self._parts: dict[int, list[str]] = {}  # per choice: the deltas (OpenAI) or the latest whole text

    def feed(self, chunk: bytes) -> None:
        self._pending += chunk
        *events, self._pending = self._pending.split(b"\n\n")
        for event in events:
            for line in event.split(b"\n"):
                if line.startswith(b"data:"):
                    self._event(line[5:].strip())

    def _event(self, data: bytes) -> None:
        if not data or data == b"[DONE]":
            return
        try:
            doc = orjson.loads(data)
        except orjson.JSONDecodeError:
            return
        if isinstance(doc, dict) and "error" not in doc:
            self.add(doc)

    def add(self, doc: dict[str, Any]) -> None:
        """One parsed ``data:`` event (not an error event)."""
        if self.route == GENERATE:
            index = doc.get("index", 0)
            if isinstance(index, int) and isinstance(doc.get("text"), str):
                self._parts[index] = [doc["text"]]
            return
        chat = self.route == CHAT
        for choice in doc.get("choices") or ():
            if isinstance(choice, dict) and isinstance(i := choice.get("index", 0), int):
                parts = self._parts.get(i)
                if parts is None:
                    parts = self._parts[i] = []
                if not chat:
                    text = choice.get("text")
                    if isinstance(text, str):
                        parts.append(text)
                    continue
                delta = choice.get("delta")  # a chat delta's text as _choice_text has it, without a join per event
                if delta:
                    if isinstance(reasoning := delta.get("reasoning_content"), str):
                        parts.append(reasoning)
                    if isinstance(content := delta.get("content"), str):
                        parts.append(content)

    def texts(self) -> list[str]:
        return ["".join(self._parts[i]) for i in sorted(self._parts)]
