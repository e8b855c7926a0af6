"""OpenAI streaming (SSE) of one request's choices: text deltas per choice index, SGLang 0.5.23's chunk shapes."""

from __future__ import annotations

from typing import Any

from aiohttp import web

from tandem_sim.api import responses
from tandem_sim.api.openai_requests import OpenAIRequest
from tandem_sim.api.responses import Outcome
from tandem_sim.worker import OnProgress


class OpenAIStream:
    def __init__(self, resp: web.StreamResponse, model_name: str, created: int, chat: bool, req: OpenAIRequest):
        self.resp = resp
        self.model_name = model_name
        self.created = created
        self.chat = chat
        self.req = req
        self.sent_chars = [0] * len(req.items)
        self.sent_role = [False] * len(req.items)
        self.echoed = [False] * len(req.items)
        self.sent_logprobs = [0] * len(req.items)  # output tokens whose logprobs went out (SGLang's n_prev_token)

    def progress(self, index: int) -> OnProgress:
        async def on_progress(out: Outcome) -> None:
            await self.emit(index, out, final=False)

        return on_progress

    def _new_logprobs(self, index: int, out: Outcome) -> dict[str, Any] | None:
        """Logprobs of the output tokens not sent yet, None when there are none (``serving_chat.
        _process_streaming_logprobs``, ``serving_completions``: ``n_prev_token < total_output_logprobs``)."""
        start, end = self.sent_logprobs[index], len(out.token_logprobs)
        if out.top_logprobs_num is None or start >= end:
            return None
        self.sent_logprobs[index] = end
        if self.chat:
            return responses.chat_logprobs(out, start, end)
        return responses.completion_logprobs(out, start, end)

    async def emit(self, index: int, out: Outcome, final: bool) -> None:
        delta_text = out.text[self.sent_chars[index] :]
        self.sent_chars[index] = len(out.text)
        with_usage = self.req.continuous_usage
        if not self.chat:
            if self.req.echo and not self.echoed[index]:  # the first chunk of a choice carries its echo
                delta_text = self.req.echo[index] + delta_text
                self.echoed[index] = True
            logprobs = self._new_logprobs(index, out)
            chunk = responses.completion_chunk(
                out, index, self.model_name, self.created, delta_text, final, with_usage, logprobs
            )
            await self.resp.write(responses.sse(chunk))
            return
        tool_call = self.req.tool_call
        delta: dict[str, Any] = {"content": None if tool_call else delta_text, "reasoning_content": None}
        delta["tool_calls"] = None
        if not self.sent_role[index]:
            delta["role"] = "assistant"
            self.sent_role[index] = True
        if final:
            message, reason, matched = responses.chat_message(out, tool_call)
            delta["tool_calls"] = message.get("tool_calls")
            finish = (reason, matched)
        else:
            finish = (None, None)
        if tool_call and not final and "role" not in delta:
            return  # a forced tool call is streamed as one call at the end
        logprobs = self._new_logprobs(index, out)
        chunk = responses.chat_chunk(out, index, self.model_name, self.created, delta, finish, with_usage, logprobs)
        await self.resp.write(responses.sse(chunk))
