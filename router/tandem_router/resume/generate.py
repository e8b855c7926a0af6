"""Resuming a SGLang ``/generate`` stream token for token: ``input_ids`` = the prompt's ids + the relayed ids. Pure.

SGLang 0.5.23 streams ``/generate`` as ``data: {"text", "output_ids", "meta_info": {"id", "finish_reason",
"prompt_tokens", "completion_tokens", ...}}`` events then ``data: [DONE]`` (``TokenizerManager.
_handle_batch_output``). By default (``--incremental-streaming-output`` off) ``text`` and ``output_ids`` are the
whole output so far; with it, each event carries only what is new. The ledger tells the two apart by the events
(``output_ids`` shorter than ``completion_tokens``: incremental) and takes the default until a second event shows
it.

The continuation is the same request with ``input_ids`` = prompt ids + every output id relayed (``text`` dropped),
``max_new_tokens``/``min_new_tokens`` shrunk by them and every other field (``sampling_seed``, ``temperature``,
``rid``) kept: the model reads exactly the tokens it had, so a greedy or seeded stream continues as it would have
(given deterministic kernels, ``--enable-deterministic-inference``). The prompt's ids are the client's
``input_ids``; for a ``text`` prompt the router asks for ``return_prompt_token_ids`` (SGLang then adds
``prompt_token_ids`` to every event, ``io_struct.GenerateReqInput``) and drops them again unless the client asked.
The new stream is shaped into the old one: ``text`` and ``output_ids`` continue the relayed ones, ``meta_info``
keeps the first stream's ``id`` and ``prompt_tokens`` and counts ``completion_tokens`` over the whole output.
"""

from __future__ import annotations

import copy
from typing import Any

from tandem_router.openai.requests import ParsedRequest
from tandem_router.resume.ledger import Refusal, StreamLedger, shrink

NO_PROMPT_IDS = Refusal("no_prompt_ids", "the worker did not return the prompt's token ids")
IDS_MISSING = Refusal("no_output_ids", "the worker's events did not carry every output token id")
SGLANG_DEFAULT_MAX_NEW_TOKENS = 128  # sampling/sampling_params.py: SamplingParams.max_new_tokens = 128


class GenerateLedger(StreamLedger):
    """A ``/generate`` stream of one sequence (a ``text`` or flat ``input_ids`` prompt, ``n`` = 1)."""

    def __init__(self, request: ParsedRequest) -> None:
        super().__init__(request)
        body = request.body
        ids = body.get("input_ids")
        self.prompt_ids: list[int] | None = list(ids) if isinstance(ids, list) else None
        self.output_ids: list[int] = []
        self.text = ""
        self.rid: Any = None
        self.prompt_tokens: Any = None
        self.incremental: bool | None = None  # --incremental-streaming-output (None: not seen yet)
        self._base_ids = 0  # output ids and text relayed before the current segment
        self._base_text = ""
        self._client_prompt_ids = body.get("return_prompt_token_ids") is True  # the client asked for them

    def upstream(self) -> dict[str, Any]:
        return self.body if self.prompt_ids is not None else {**self.body, "return_prompt_token_ids": True}

    def _refusal(self) -> Refusal | None:
        if self.prompt_ids is None:
            return NO_PROMPT_IDS
        return IDS_MISSING if len(self.output_ids) != self.sent_tokens else None

    def next_segment(self) -> None:
        super().next_segment()
        self._base_ids, self._base_text = len(self.output_ids), self.text

    def _shape(self, doc: dict[str, Any]) -> bool:
        self._edited = True  # the prompt's ids the router asked for are cut out or restored in every event
        prompt_ids = doc.get("prompt_token_ids")
        if self.segment == 0 and self.prompt_ids is None and isinstance(prompt_ids, list):
            self.prompt_ids = [int(t) for t in prompt_ids]
        if self._client_prompt_ids:
            doc["prompt_token_ids"] = self.prompt_ids
        else:
            doc.pop("prompt_token_ids", None)
        meta = doc.get("meta_info")
        meta = meta if isinstance(meta, dict) else {}
        ids = doc.get("output_ids")
        ids = ids if isinstance(ids, list) else []
        text = doc.get("text")
        text = text if isinstance(text, str) else ""
        completion = meta.get("completion_tokens")
        completion = completion if isinstance(completion, int) else len(ids)
        if len(ids) < completion:
            self.incremental = True
        elif self.incremental is None and completion > 1 and self.output_ids:
            self.incremental = False  # a second event with the whole output
        if self.incremental:
            self.output_ids += ids
            self.text += text
        else:
            self.output_ids = self.output_ids[: self._base_ids] + ids
            self.text = self._base_text + text
            if self.segment:
                doc["output_ids"], doc["text"] = list(self.output_ids), self.text
        self.sent_tokens = self._base_tokens + completion
        if self.segment == 0:
            self.rid, self.prompt_tokens = meta.get("id"), meta.get("prompt_tokens")
        elif meta:
            meta.update(id=self.rid, prompt_tokens=self.prompt_tokens, completion_tokens=self.sent_tokens)
        if meta.get("finish_reason") is not None:
            self.finished = True
        return True

    def _params(self) -> dict[str, Any]:
        params = self.body.get("sampling_params")
        return dict(params) if isinstance(params, dict) else {}

    def _remaining_tokens(self) -> int | None:
        limit = self.request.limit_or(SGLANG_DEFAULT_MAX_NEW_TOKENS)
        return None if limit is None else max(limit - self.sent_tokens, 0)

    def continuation(self) -> dict[str, Any]:
        assert self.prompt_ids is not None  # checked by ``refusal``
        body = copy.deepcopy(self.body)
        body.pop("text", None)
        body["input_ids"] = self.prompt_ids + self.output_ids
        params = self._params()
        params.setdefault("max_new_tokens", SGLANG_DEFAULT_MAX_NEW_TOKENS)
        shrink(params, ("max_new_tokens",), "min_new_tokens", self.sent_tokens)
        body["sampling_params"] = params
        return body
