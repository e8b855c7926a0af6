"""What a request asks of flow control: its own ``priority`` (SGLang's request field) and its estimated tokens."""

from __future__ import annotations

from typing import Any

from tandem_router.openai.requests import output_limit
from tandem_router.openai.schema import Route

CHARS_PER_TOKEN = 4


def asked_priority(body: dict[str, Any]) -> int | None:
    value = body.get("priority")
    return value if isinstance(value, int) and not isinstance(value, bool) else None


def estimated_tokens(route: Route, body: dict[str, Any], prompt_chars: int) -> float:
    """Prompt characters / 4 plus the output limit the request sets (none set: the prompt alone)."""
    limit = output_limit(route, body)
    output = limit if isinstance(limit, int) and not isinstance(limit, bool) and limit > 0 else 0
    choices = body.get("n")
    n = choices if isinstance(choices, int) and not isinstance(choices, bool) and choices > 1 else 1
    return prompt_chars / CHARS_PER_TOKEN + output * n
