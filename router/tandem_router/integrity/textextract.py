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


def body_texts(route: str, body: bytes) -> list[str]:
    """Texts of a complete (non-streaming) response body; [] when it is not JSON."""
    try:
        return _texts(route, orjson.loads(body), delta=False)
    except orjson.JSONDecodeError:
        return []


class StreamTexts:
    """Accumulates the text of each choice/index from SSE chunks."""

    def __init__(self, route: str) -> None:
        self.route = route
        self._pending = b""
        self._texts: dict[int, str] = {}

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
        if not isinstance(doc, dict) or "error" in doc:
            return
        if self.route == GENERATE:
            index = doc.get("index", 0)
            if isinstance(index, int) and isinstance(doc.get("text"), str):
                self._texts[index] = doc["text"]
            return
        for choice in doc.get("choices") or []:
            if isinstance(choice, dict) and isinstance(choice.get("index", 0), int):
                i = choice.get("index", 0)
                self._texts[i] = self._texts.get(i, "") + _choice_text(self.route, choice, delta=self.route == CHAT)

    def texts(self) -> list[str]:
        return [self._texts[i] for i in sorted(self._texts)]
