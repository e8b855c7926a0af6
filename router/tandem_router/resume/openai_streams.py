"""Resuming OpenAI chat and completions streams: text continuation, token counts from per-chunk usage. Pure.

Chat: the relayed text becomes a final assistant message with ``continue_final_message`` (SGLang 0.5.23
``serving_chat._handle_last_assistant_message`` drops that message and ``_append_assistant_prefix_to_prompt_ids``
appends its tokens after the generation prompt), so the model sees the prompt followed by what it already said.
Completions: the relayed text is appended to the prompt (SGLang's detokenizer gives each output the text its tokens
add after the prompt, ``DetokenizerManager``: ``read_texts[i][len(surr_texts[i]):]``, so prompt + output is the
text the model has read). Either way ``max_tokens``/``max_completion_tokens``/``min_tokens`` shrink by the tokens
already sent, and the seed and every other sampling field stay.

Token counts come from SGLang's ``continuous_usage_stats`` (every chunk carries the usage so far): the router asks
the worker for them and drops them again unless the client asked for them. Re-tokenizing the relayed text is
token-exact for the tokenizers this targets (byte-level BPE pieces that the tokenizer merges the same way, at word
boundaries); it is not guaranteed for every tokenizer, which is why only temperature-0 or seeded streams are
claimed to continue "as if nothing happened". The new stream is shaped into the old one: the first stream's ``id``
and ``created``, no second ``role`` delta, no second echo, usage counted over the whole answer.
"""

from __future__ import annotations

import copy
from abc import abstractmethod
from typing import Any

from tandem_router.openai.requests import ParsedRequest
from tandem_router.openai.schema import ROUTES, Route
from tandem_router.resume.ledger import NOT_COUNTED, Refusal, StreamLedger, shrink

REASONING_SENT = Refusal(
    "reasoning",
    "reasoning content was sent (the reasoning parser's markup is not in the relayed text, so the model cannot be "
    "shown where it stopped)",
)
COMPLETIONS_DEFAULT_MAX_TOKENS = 16  # SGLang 0.5.23 protocol.py: CompletionRequest.max_tokens = 16
_LIMITS = ROUTES[Route.CHAT].output_limits  # both OpenAI routes' limit fields (the completions route has max_tokens)


class _OpenAIStreamLedger(StreamLedger):
    def __init__(self, request: ParsedRequest) -> None:
        super().__init__(request)
        body = request.body
        self.stream_id: str | None = None
        self.created: int | None = None
        self.prompt_tokens: int | None = None
        self._text: list[str] = []
        options = body.get("stream_options")
        options = options if isinstance(options, dict) else {}
        self._client_usage = bool(options.get("include_usage"))  # the final usage chunk is the client's
        self._client_continuous = bool(options.get("continuous_usage_stats"))  # so is every chunk's usage

    @property
    def text(self) -> str:
        return "".join(self._text)

    def upstream(self) -> dict[str, Any]:
        return _with_usage(self.body)

    def _refusal(self) -> Refusal | None:
        return NOT_COUNTED if self.prompt_tokens is None and self._text else None

    def _shape(self, doc: dict[str, Any]) -> bool:
        if self.stream_id is None:
            self.stream_id, self.created = doc.get("id"), doc.get("created")
        elif doc.get("id") != self.stream_id or doc.get("created") != self.created:
            doc["id"], doc["created"] = self.stream_id, self.created
            self._edited = True
        choices = doc.get("choices") or []
        visible = self._usage(doc, final=not choices)
        for choice in choices:
            if isinstance(choice, dict):
                visible = self._choice(choice) and visible
                if choice.get("finish_reason") is not None:
                    self.finished = True
        return visible

    @abstractmethod
    def _choice(self, choice: dict[str, Any]) -> bool:
        """Record and rewrite one choice of a chunk; False: the chunk is not for the client."""

    def _usage(self, doc: dict[str, Any], *, final: bool) -> bool:
        """Usage over the whole answer; the chunk's usage as the client asked for it. False: drop the chunk."""
        usage = doc.get("usage")
        if usage is None:
            return self._client_usage if final else True
        hidden = not final and not self._client_continuous  # the usage the router asked for, not the client
        if isinstance(usage, dict):
            if self.prompt_tokens is None:
                self.prompt_tokens = usage.get("prompt_tokens")
            completion = self._base_tokens + int(usage.get("completion_tokens") or 0)
            self.sent_tokens = completion
            prompt = self.prompt_tokens or 0
            if not hidden and (
                usage.get("prompt_tokens") != prompt
                or usage.get("completion_tokens") != completion
                or usage.get("total_tokens") != prompt + completion
            ):
                total = prompt + completion
                doc["usage"] = {
                    **usage,
                    "prompt_tokens": prompt,
                    "completion_tokens": completion,
                    "total_tokens": total,
                }
                self._edited = True
        if final:
            return self._client_usage
        if hidden:
            doc["usage"] = None
            self._edited = True
        return True

    def _limit(self) -> int | None:
        return self.request.output_limit

    def _remaining_tokens(self) -> int | None:
        limit = self._limit()
        return None if limit is None else max(limit - self.sent_tokens, 0)

    def _shrunk(self, body: dict[str, Any]) -> dict[str, Any]:
        shrink(body, _LIMITS, "min_tokens", self.sent_tokens)
        return _with_usage(body)


class ChatLedger(_OpenAIStreamLedger):
    """A ``/v1/chat/completions`` stream of one choice, without tools."""

    def __init__(self, request: ParsedRequest) -> None:
        super().__init__(request)
        self.reasoning = False  # reasoning content was relayed

    def _refusal(self) -> Refusal | None:
        return REASONING_SENT if self.reasoning else super()._refusal()

    def _choice(self, choice: dict[str, Any]) -> bool:
        delta = choice.get("delta")
        if not isinstance(delta, dict):
            return True
        visible = True
        if self.segment and delta.get("role") is not None:
            del delta["role"]
            self._edited = True
            if not delta.get("content") and not delta.get("tool_calls") and choice.get("finish_reason") is None:
                visible = False  # the new stream's opening (role only): the client had it already
        if isinstance(delta.get("content"), str):
            self._text.append(delta["content"])
        if delta.get("reasoning_content"):
            self.reasoning = True
        return visible

    def continuation(self) -> dict[str, Any]:
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
        return self._shrunk(body)


class CompletionLedger(_OpenAIStreamLedger):
    """A ``/v1/completions`` stream of one choice for one text prompt."""

    def __init__(self, request: ParsedRequest) -> None:
        super().__init__(request)
        body = request.body
        prompt = body["prompt"]
        self.prompt: str = prompt if isinstance(prompt, str) else prompt[0]
        self._echo_left = bool(body.get("echo"))  # the first text carries the prompt (``echo``): not output

    def _choice(self, choice: dict[str, Any]) -> bool:
        text = choice.get("text")
        if isinstance(text, str):
            if self._echo_left and text:
                self._echo_left = False
                text = text.removeprefix(self.prompt)
            self._text.append(text)
        return True

    def _limit(self) -> int | None:
        return self.request.limit_or(COMPLETIONS_DEFAULT_MAX_TOKENS)

    def continuation(self) -> dict[str, Any]:
        body = copy.deepcopy(self.body)
        prompt = self.prompt + self.text
        body["prompt"] = prompt if isinstance(body["prompt"], str) else [prompt]
        body["echo"] = False  # the client has the echo already
        body["max_tokens"] = self._limit()
        return self._shrunk(body)


def _with_usage(body: dict[str, Any]) -> dict[str, Any]:
    """The request as sent to the workers: the usage of every chunk asked for (the ledger counts tokens with it)."""
    options = body.get("stream_options")
    options = dict(options) if isinstance(options, dict) else {}
    return {**body, "stream_options": {**options, "include_usage": True, "continuous_usage_stats": True}}
