"""What a request asks of flow control: its estimated tokens (its ``priority`` is ``ParsedRequest.priority``)."""

from __future__ import annotations

from tandem_router.openai.requests import ParsedRequest

CHARS_PER_TOKEN = 4


def estimated_tokens(request: ParsedRequest, prompt_chars: int) -> float:
    """Prompt characters / 4 plus the output limit the request sets (none set: the prompt alone) for every sequence
    it generates: each prompt of a batch times its choices (OpenAI's ``n``, /generate's ``sampling_params.n``), so
    that asking for many sequences in one request is charged like asking for them one by one."""
    limit = request.output_limit
    output = limit if limit is not None and limit > 0 else 0
    return prompt_chars / CHARS_PER_TOKEN + output * max(request.items, 1)
