"""Resuming a stream on a fresh pair after the client got tokens: which streams can be resumed, and how. Pure.

``new_ledger`` gives the ledger that relays a resumable stream (``ledger.StreamLedger``), or the ``Refusal`` that
says why the stream cannot be resumed; a stream can also become unresumable on the way (``StreamLedger.refusal``).
A refused stream whose pair breaks ends with the OpenAI error event, naming the reason.

Resumed: ``/v1/chat/completions`` and ``/v1/completions`` streams of one choice (text continuation,
``openai_streams``), ``/generate`` streams of one sequence (token for token, ``generate``). Refused, by design:

- ``n`` > 1: one continuation request cannot give each choice its own relayed prefix and remaining length, and
  sampled choices share one seed, so a choice cannot be re-drawn alone;
- tools (``tools`` or ``tool_choice``): the tool parser's state (a call's arguments streamed in part, or held
  back until the call is complete) is not in the relayed text, so a continuation could repeat or split a call;
- reasoning content already sent (chat): the reasoning parser's markup is not in the relayed text;
- ``logprobs`` (completions, ``/generate`` ``return_logprob``): a continuation would count offsets and positions
  from its own start;
- a completions prompt of token ids, or a batch; a ``/generate`` batch, ``n`` > 1, or a prompt other than text or
  token ids (multimodal, embeddings).
"""

from __future__ import annotations

from dataclasses import dataclass

from tandem_router.openai.requests import ParsedRequest
from tandem_router.openai.schema import Route
from tandem_router.resume.generate import GenerateLedger
from tandem_router.resume.ledger import Refusal, StreamLedger
from tandem_router.resume.openai_streams import ChatLedger, CompletionLedger

__all__ = ["RESUME_OFF", "Refusal", "ResumeConfig", "StreamLedger", "new_ledger"]

RESUME_OFF = Refusal("off", "resume is off (--resume-max-attempts 0)")
NOT_STREAMED = Refusal("not_streamed", "the request is not a stream")
MANY_CHOICES = Refusal("n", "n > 1: the choices cannot be continued one by one")
TOOLS = Refusal("tools", "tool calling: the tool parser's state is not in the relayed text")
LOGPROBS = Refusal("logprobs", "logprobs: a continuation would count their offsets from its own start")
BATCH = Refusal("batch", "a batch of prompts")
TOKEN_PROMPT = Refusal("token_prompt", "a prompt of token ids: the relayed text cannot be appended to it")
OTHER_INPUT = Refusal("input", "an input other than one text or one list of token ids")
_MULTIMODAL = ("image_data", "video_data", "audio_data", "input_embeds")


@dataclass(frozen=True)
class ResumeConfig:
    max_attempts: int = 2  # fresh pairs tried per stream after its first byte, all breaks together
    deadline_s: float = 30.0  # from the first break: past this no further pair is tried


def new_ledger(request: ParsedRequest) -> StreamLedger | Refusal:
    """The ledger that relays ``request``'s stream so it can be resumed, or why it cannot be. The stream flag and
    ``n`` are the parsed request's; what only resume asks about (tools, logprobs, the prompt's form) is read here."""
    if not request.stream:
        return NOT_STREAMED
    route, body = request.route, request.body
    if route is Route.GENERATE:
        return _generate(request)
    if request.n != 1:
        return MANY_CHOICES
    if route is Route.CHAT:
        if body.get("tools") or body.get("tool_choice") not in (None, "none"):
            return TOOLS
        messages = body.get("messages")
        if not isinstance(messages, list) or not messages or not all(isinstance(m, dict) for m in messages):
            return OTHER_INPUT
        return ChatLedger(request)
    if body.get("logprobs") is not None:
        return LOGPROBS
    prompt = body.get("prompt")
    if isinstance(prompt, list) and len(prompt) == 1 and isinstance(prompt[0], str):
        prompt = prompt[0]
    if isinstance(prompt, str) and prompt:
        return CompletionLedger(request)
    if isinstance(prompt, list) and prompt and all(isinstance(t, int) for t in prompt):
        return TOKEN_PROMPT
    return BATCH if isinstance(prompt, list) else OTHER_INPUT


def _generate(request: ParsedRequest) -> StreamLedger | Refusal:
    body = request.body
    params = body.get("sampling_params")
    if params is not None and not isinstance(params, dict):
        return BATCH  # one sampling_params per item
    if request.n != 1:
        return MANY_CHOICES
    if body.get("return_logprob"):
        return LOGPROBS
    if any(body.get(key) is not None for key in _MULTIMODAL):
        return OTHER_INPUT
    text, ids = body.get("text"), body.get("input_ids")
    if isinstance(text, list) or (isinstance(ids, list) and ids and isinstance(ids[0], list)):
        return BATCH
    if (isinstance(text, str) and text and ids is None) or (
        text is None and isinstance(ids, list) and ids and all(isinstance(t, int) for t in ids)
    ):
        return GenerateLedger(request)
    return OTHER_INPUT
