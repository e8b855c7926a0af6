"""What a request asks of flow control: its estimated tokens (its ``priority`` is ``ParsedRequest.priority``)."""

from __future__ import annotations

from tandem_router.openai.requests import ParsedRequest
from tandem_router.openai.schema import Route

CHARS_PER_TOKEN = 4


def estimated_tokens(request: ParsedRequest, prompt_chars: int) -> float:
    """Prompt characters / 4 plus the output limit the request sets (none set: the prompt alone), times its choices.

    /generate counts one choice: its ``n`` is ``sampling_params.n``, which the estimate has not counted so far."""
    limit = request.output_limit
    output = limit if limit is not None and limit > 0 else 0
    n = request.n if request.route is not Route.GENERATE and request.n > 1 else 1
    return prompt_chars / CHARS_PER_TOKEN + output * n
