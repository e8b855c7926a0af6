"""One simulated SGLang worker process: runs a parsed request in aggregated, prefill or decode mode.

``Worker.run`` is the whole life of a request (admission, prompt KV, decode loop, release); the HTTP layer
(``server.py``) only parses bodies and formats responses.
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import Awaitable, Callable
from typing import Any

from tandem_sim import model
from tandem_sim.config import SimConfig
from tandem_sim.decode import DecodeSide, KVTransferError
from tandem_sim.engine import Engine, RunningRequest
from tandem_sim.kvpool import OutOfPagesError
from tandem_sim.metrics import Metrics
from tandem_sim.prefill import PrefillSide, TransferFailedError
from tandem_sim.requests import GenerateInput
from tandem_sim.responses import Outcome
from tandem_sim.transfer import MooncakeTransfer


class GenerationError(RuntimeError):
    """The request failed; ``status`` is the HTTP status SGLang answers with."""

    def __init__(self, message: str, status: int) -> None:
        super().__init__(message)
        self.status = status


OnProgress = Callable[[Outcome], Awaitable[None]]


class Worker:
    def __init__(self, cfg: SimConfig, metrics: Metrics, rank_host: str) -> None:
        self.cfg = cfg
        self.metrics = metrics
        self.engine = Engine(cfg, metrics)
        self.transfer: MooncakeTransfer | None = None
        self.prefill: PrefillSide | None = None
        self.decode: DecodeSide | None = None
        if cfg.mode != "null":
            self.transfer = MooncakeTransfer(rank_host)
            if cfg.mode == "prefill":
                self.prefill = PrefillSide(cfg, metrics, self.transfer)
            else:
                self.decode = DecodeSide(cfg, metrics, self.transfer, self.engine.pool)
        self.tasks: dict[str, asyncio.Task[Any]] = {}
        self._background: set[asyncio.Task[None]] = set()

    async def run(self, inp: GenerateInput, on_progress: OnProgress | None = None) -> Outcome:
        """Run one request to the end. Raises GenerationError (SGLang's status and message)."""
        out = Outcome(inp.rid, len(inp.input_ids))
        started = time.monotonic()
        if self.cfg.mode == "prefill":
            await self._run_prefill(inp, out)
        else:
            await self._run_decode(inp, out, on_progress)
        self.metrics.num_requests.inc()
        self.metrics.e2e_latency.observe(time.monotonic() - started)
        return out

    async def _run_prefill(self, inp: GenerateInput, out: Outcome) -> None:
        if self.prefill is None or inp.bootstrap is None:
            raise GenerationError("prefill mode requires bootstrap fields", 400)
        room = inp.bootstrap.room
        try:
            await self.prefill.prefill(room, inp.prompt)
        except TransferFailedError as err:
            raise GenerationError(
                f"Prefill transfer failed for request rank=0 req.rid={inp.rid!r} req.bootstrap_room={room} "
                f"with exception {KVTransferError(room, str(err))}",
                500,
            ) from None
        out.finish_reason = {"type": "length", "length": 0}

    async def _run_decode(self, inp: GenerateInput, out: Outcome, on_progress: OnProgress | None) -> None:
        req = RunningRequest(inp.rid, inp.prompt, inp.params)
        try:
            await self.engine.admit(req)
        except OutOfPagesError as err:
            raise GenerationError(f"Request does not fit the KV cache: {err}", 400) from None
        received = False
        try:
            if self.decode is not None:
                received = await self._receive(inp, req)
            else:
                await asyncio.sleep(self.cfg.prefill_ms_per_token * len(inp.input_ids) / 1000.0)
                self.engine.write_prompt_kv_locally(req)
                self.metrics.prompt_tokens.inc(len(inp.input_ids))
                received = True
            first = time.monotonic()
            stops = inp.params.stop

            async def on_token(token: int, word: str) -> bool:
                out.output_ids.append(token)
                if len(out.output_ids) == 1:
                    self.metrics.ttft.observe(first - out.started)
                before = len(out.text)
                text = f"{out.text} {word}" if out.text else word
                for stop in stops:
                    cut = text.find(stop, max(0, before - len(stop)))
                    if cut >= 0:
                        out.text = text[:cut].rstrip()
                        out.finish_reason = {"type": "stop", "matched": stop}
                        return False
                out.text = text
                if on_progress is not None:
                    await on_progress(out)
                return True

            reason = await self.engine.decode(req, on_token)
            if out.finish_reason is None:
                if reason == "stop":
                    out.finish_reason = {"type": "stop", "matched": model.EOS_ID}
                else:
                    out.finish_reason = {"type": "length", "length": len(out.output_ids)}
        finally:
            if self.decode is not None and inp.bootstrap is not None and not received:
                # SGLang's deferred decode KV release: the pages stay held until the prefill stopped writing.
                task = asyncio.get_running_loop().create_task(self._deferred_release(inp.bootstrap.room, req))
                self._background.add(task)
                task.add_done_callback(self._background.discard)
            else:
                await self.engine.release(req)

    async def _deferred_release(self, room: int, req: RunningRequest) -> None:
        if self.decode is not None:
            await self.decode.quiesce(room)
        await self.engine.release(req)

    async def _receive(self, inp: GenerateInput, req: RunningRequest) -> bool:
        if self.decode is None or inp.bootstrap is None:
            raise GenerationError("decode mode requires bootstrap fields", 400)
        b = inp.bootstrap
        port = b.port if b.port is not None else self.cfg.bootstrap_port
        try:
            await self.decode.receive_kv(b.room, b.host, port, req.pages)
        except KVTransferError as err:
            raise GenerationError(
                f"Decode transfer failed for request rank=0 decode_req.req.rid={inp.rid!r} "
                f"decode_req.req.bootstrap_room={b.room} with exception {err}",
                500,
            ) from None
        return True

    async def health_generate(self) -> None:
        """SGLang's health check: a 1-token generation; PD modes run it without a peer (fake bootstrap)."""
        prompt = model.tokenize("health check")
        req = RunningRequest("HEALTH_CHECK", prompt, model.SamplingParams(max_new_tokens=1, ignore_eos=True))
        await self.engine.admit(req)
        try:
            self.engine.write_prompt_kv_locally(req)
            await self.engine.decode(req)
        finally:
            await self.engine.release(req)

    def internal_state(self) -> dict[str, Any]:
        state: dict[str, Any] = dict(self.engine.internal_state())
        if self.prefill is not None:
            state.update(self.prefill.internal_state())
        if self.decode is not None:
            state.update(self.decode.internal_state())
        return state

    async def close(self) -> None:
        for task in list(self._background):
            task.cancel()
        if self.decode is not None:
            await self.decode.close()
        if self.transfer is not None:
            self.transfer.close()
