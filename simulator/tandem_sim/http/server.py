"""The HTTP surface of SGLang 0.5.23's ``http_server.py`` for the simulated worker (aiohttp).

Native ``/generate``; OpenAI ``/v1/completions``, ``/v1/chat/completions`` (streaming, ``usage``),
``/v1/models``; ``/health``, ``/health_generate``, ``/ready``, ``/model_info``, ``/server_info`` (+ ``/get_*``),
``/flush_cache``, ``/abort_request``, ``/metrics``, a seed's ``/remote_instance_transfer_engine_info``
(``pd/seed.py``). ``/tandem/sim/faults`` changes fault injection at runtime.
The health endpoints and the server status are SGLang's (``health.py``)
Each prefill rank serves its PD hand-over on its own port (``pd/rankserver.py``).
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import logging
import time
from collections.abc import Awaitable, Callable, Coroutine
from typing import Any

import orjson
from aiohttp import web

from tandem.sglang_args import SGLANG_VERSION
from tandem_sim.api import responses
from tandem_sim.api.contract import ContractError
from tandem_sim.api.openai_requests import parse_openai
from tandem_sim.api.requests import BadRequestError, GenerateInput, parse_generate
from tandem_sim.api.responses import Outcome
from tandem_sim.config import SimConfig
from tandem_sim.http.health import Health
from tandem_sim.http.streaming import OpenAIStream
from tandem_sim.pd.seed import info_handler
from tandem_sim.worker import GenerationError, OnProgress, Worker, run_together

Handler = Callable[[web.Request], Awaitable[web.StreamResponse]]
log = logging.getLogger("tandem_sim.server")


def _log_ignored(path: str, ignored: tuple[str, ...]) -> None:
    """SGLang ignores request fields it does not know (tandem_sim.api.sglang_fields); so do we, at debug level."""
    if ignored:
        log.debug("ignoring unknown field(s) in %s request: %s", path, ", ".join(ignored))


def _json(doc: Any, status: int = 200) -> web.Response:
    return web.Response(body=orjson.dumps(doc), status=status, content_type="application/json")


class Server:
    def __init__(
        self, cfg: SimConfig, worker: Worker, ready: Callable[[], bool], warmed: Callable[[], bool] = lambda: True
    ) -> None:
        self.cfg = cfg
        self.worker = worker
        self.ready = ready
        self.created = int(time.time())
        self.weights: dict[str, Any] = {}  # the load report (pd/loader.py), under /server_info's tandem_sim
        self.health_state = Health(
            [engine.stepper for engine in worker.engines.values()],
            prefill=cfg.mode == "prefill",
            timeout_s=cfg.pd.health_check_timeout_s,
            generation_on_health=cfg.pd.health_generation,
            started=lambda: ready() and warmed(),  # status Starting until the warm-up request passed
            slow_s=lambda: cfg.slow_health_s if worker.engine.running > 0 else 0.0,
        )

        self._hung = False  # the hang fault
        self._paused_in_place = False  # /pause_generation in_place or retract

    def hang(self, on: bool = True) -> None:
        """Every scheduler of the node stops (or goes on): ``--sim-inject-hang-after-s``, ``{"hang": true}``."""
        self._hung = on
        self._apply_schedulers()
        log.warning("scheduler hung" if on else "scheduler resumed")

    def _apply_schedulers(self) -> None:
        for engine in self.worker.engines.values():
            if self._hung or self._paused_in_place:
                engine.stepper.hang()
            else:
                engine.stepper.resume()

    def app(self) -> web.Application:
        app = web.Application(client_max_size=64 * 1024 * 1024)
        r = app.router
        r.add_post("/generate", self.generate)
        r.add_post("/v1/completions", self.completions)
        r.add_post("/v1/chat/completions", self.chat)
        r.add_get("/v1/models", self.models)
        for path in ("/health", "/health_generate"):
            r.add_get(path, self.health)
        r.add_get("/ready", self.ready_check)
        for path in ("/model_info", "/get_model_info"):
            r.add_get(path, self.model_info)
        for path in ("/server_info", "/get_server_info"):
            r.add_get(path, self.server_info)
        r.add_route("*", "/flush_cache", self.flush_cache)
        r.add_post("/abort_request", self.abort_request)
        r.add_post("/pause_generation", self.pause_generation)
        r.add_post("/continue_generation", self.continue_generation)
        r.add_get("/metrics", self.metrics)
        for path, deprecated in (
            ("/remote_instance_transfer_engine_info", False),
            ("/get_remote_instance_transfer_engine_info", True),
        ):
            r.add_get(
                path, info_handler(self.cfg.host, self.cfg.load.engine_info_bootstrap_port, deprecated=deprecated)
            )
        r.add_post("/tandem/sim/faults", self.faults)
        return app

    # -- generation -------------------------------------------------------------------------------------------
    async def _body(self, request: web.Request) -> Any:
        raw = await request.read()
        try:
            return orjson.loads(raw)
        except orjson.JSONDecodeError as err:
            raise BadRequestError(f"Invalid JSON body: {err}") from None

    def _not_ready(self) -> GenerationError | None:
        return None if self.ready() else GenerationError("The server is not ready yet", 503)

    async def _track(self, inp: GenerateInput, coro: Coroutine[Any, Any, responses.Outcome]) -> responses.Outcome:
        task = asyncio.ensure_future(self._when_unpaused(coro))
        self.worker.tasks[inp.rid] = task
        try:
            return await task
        finally:
            self.worker.tasks.pop(inp.rid, None)

    async def _when_unpaused(self, coro: Coroutine[Any, Any, responses.Outcome]) -> responses.Outcome:
        try:
            await self.health_state.wait_unpaused()  # the tokenizer holds requests while generation is paused
        except BaseException:
            coro.close()
            raise
        return await coro

    async def _run_all(self, items: list[GenerateInput], progress: list[OnProgress] | None = None) -> list[Outcome]:
        """Run every item (batch entry or choice) concurrently; the first failure fails the request."""
        return await run_together(
            [
                self._track(inp, self.worker.run(inp, None if progress is None else progress[i]))
                for i, inp in enumerate(items)
            ]
        )

    async def generate(self, request: web.Request) -> web.StreamResponse:
        try:
            if (not_ready := self._not_ready()) is not None:
                raise not_ready
            parsed = parse_generate(
                await self._body(request), mode=self.cfg.mode, context_length=self.cfg.context_length
            )
        except ContractError as err:  # SGLang's contract gate: http_server.generate_request
            return _json({"error": str(err)}, 400)
        except (BadRequestError, GenerationError) as err:  # ValueErrors after the gate: _create_error_response
            return _json(responses.generate_error(str(err), err.status), err.status)
        _log_ignored(request.path, parsed.ignored)
        if not parsed.stream:
            try:
                outs = await self._run_all(parsed.items)
            except GenerationError as err:
                return _json(responses.generate_error(str(err), err.status), err.status)
            except asyncio.CancelledError:
                if request.transport is None or request.transport.is_closing():
                    raise
                return _json(responses.generate_error("Request aborted", 500), 500)
            prompts = [inp.input_ids if parsed.prompt_token_ids else None for inp in parsed.items]
            bodies = [responses.generate_body(out, None, ids) for out, ids in zip(outs, prompts, strict=True)]
            return _json(bodies if parsed.batch else bodies[0])
        resp = await self._start_stream(request)

        def chunk(out: Outcome, index: int | None) -> bytes:
            ids = parsed.items[index or 0].input_ids if parsed.prompt_token_ids else None
            return responses.sse(responses.generate_body(out, index, ids))

        def item_progress(index: int | None) -> OnProgress:
            async def progress(out: Outcome) -> None:
                await resp.write(chunk(out, index))

            return progress

        indexes: list[int | None] = list(range(len(parsed.items))) if parsed.batch else [None]
        try:
            outs = await self._run_all(parsed.items, [item_progress(i) for i in indexes])
            for index, out in zip(indexes, outs, strict=True):
                await resp.write(chunk(out, index))
        except GenerationError as err:
            await resp.write(responses.sse(responses.generate_stream_error(str(err), err.status)))
        await resp.write(responses.SSE_DONE)
        await resp.write_eof()
        return resp

    async def _start_stream(self, request: web.Request) -> web.StreamResponse:
        resp = web.StreamResponse(headers={"Content-Type": "text/event-stream", "Cache-Control": "no-cache"})
        await resp.prepare(request)
        return resp

    async def completions(self, request: web.Request) -> web.StreamResponse:
        return await self._openai(request, chat=False)

    async def chat(self, request: web.Request) -> web.StreamResponse:
        return await self._openai(request, chat=True)

    async def _openai(self, request: web.Request, chat: bool) -> web.StreamResponse:
        try:
            if (not_ready := self._not_ready()) is not None:
                raise not_ready
            body = await self._body(request)
            req = parse_openai(body, chat=chat, mode=self.cfg.mode, context_length=self.cfg.context_length)
        except (BadRequestError, GenerationError) as err:
            return _json(responses.openai_error(str(err), err.status), err.status)
        _log_ignored(request.path, req.ignored)
        name = self.cfg.served_model_name
        if not req.stream:
            try:
                outs = await self._run_all(req.items)
            except GenerationError as err:
                return _json(responses.openai_error(str(err), err.status), err.status)
            return _json(
                responses.chat_body(outs, name, self.created, req.tool_call)
                if chat
                else responses.completion_body(outs, name, self.created, req.n, req.echo)
            )
        resp = await self._start_stream(request)
        stream = OpenAIStream(resp, name, self.created, chat, req)
        try:
            outs = await self._run_all(req.items, [stream.progress(i) for i in range(len(req.items))])
            for index, out in enumerate(outs):
                await stream.emit(index, out, final=True)
            if req.include_usage:
                await resp.write(responses.sse(responses.usage_chunk(outs, name, self.created, chat, req.n)))
        except GenerationError as err:
            await resp.write(responses.sse({"error": responses.openai_error(str(err), err.status)}))
        await resp.write(responses.SSE_DONE)
        await resp.write_eof()
        return resp

    # -- info and control -------------------------------------------------------------------------------------
    async def models(self, request: web.Request) -> web.Response:
        name = self.cfg.served_model_name
        card = {
            "id": name,
            "object": "model",
            "created": self.created,
            "owned_by": "sglang",
            "root": name,
            "parent": None,
            "max_model_len": self.cfg.context_length,
        }
        return _json({"object": "list", "data": [card]})

    async def health(self, request: web.Request) -> web.Response:
        """SGLang's ``/health`` and ``/health_generate`` (``health_generate`` in
        sglang/srt/entrypoints/http_server.py): 200 once the scheduler put out anything within
        ``SGLANG_HEALTH_CHECK_TIMEOUT`` (20 s), else 503 (``health.py``). ``--sim-slow-health-s`` delays it while
        requests run."""
        return web.Response(status=await self.health_state.check(request.path))

    async def ready_check(self, request: web.Request) -> web.Response:
        """SGLang's ``/ready``: 200 or 503, no body (``TokenizerManager.is_ready``); runs nothing."""
        return web.Response(status=200 if self.health_state.ready() else 503)

    async def model_info(self, request: web.Request) -> web.Response:
        return _json(
            {
                "model_path": self.cfg.model_path,
                "tokenizer_path": self.cfg.model_path,
                "is_generation": True,
                "preferred_sampling_params": None,
                "weight_version": "default",
                "has_image_understanding": False,
                "has_audio_understanding": False,
                "model_type": "tandem_sim",
                "architectures": ["TandemSimForCausalLM"],
            }
        )

    async def server_info(self, request: web.Request) -> web.Response:
        info = dict(self.cfg.server_args)
        info["internal_states"] = self.worker.internal_states()
        info["version"] = SGLANG_VERSION
        info["tandem_sim"] = {
            "seed": self.cfg.seed,
            "kv_bytes_per_token": self.cfg.kv_bytes_per_token,
            "inject_offload_race": any(e.offload_race for e in self.worker.engines.values()),
            # model/numerics.py: batch-variant greedy output unless --enable-deterministic-inference
            "deterministic_inference": self.cfg.deterministic_inference,
            "decode_cuda_graph_bs": list(self.cfg.decode_cuda_graph_bs),
            "weights": self.weights,
        }
        return web.Response(body=orjson.dumps(info, default=str), content_type="application/json")

    async def flush_cache(self, request: web.Request) -> web.Response:
        busy = bool(self.worker.tasks)
        if not busy:
            self.worker.flush_cache()  # SGLang's Scheduler.flush_cache: tree_cache.reset()
        text = (
            "Cache flushed.\nPlease check backend logs for more details. "
            "(When there are running or waiting requests, the operation will not be performed.)"
        )
        return web.Response(text=text, status=400 if busy else 200)

    async def abort_request(self, request: web.Request) -> web.Response:
        try:
            body = await self._body(request)
        except BadRequestError as err:
            return _json({"error": str(err)}, 400)
        if not isinstance(body, dict):
            return _json({"error": "Request body must be a JSON object"}, 400)
        targets = list(self.worker.tasks) if body.get("abort_all") else [str(body.get("rid", ""))]
        for rid in targets:
            task = self.worker.tasks.get(rid)
            if task is not None:
                task.cancel()
                self.worker.metrics.num_aborted_requests.inc()
        return web.Response(status=200)

    async def pause_generation(self, request: web.Request) -> web.Response:
        """SGLang's ``/pause_generation`` (``TokenizerManager.pause_generation``): ``/ready`` answers 503 and new
        requests wait until ``/continue_generation``; ``abort`` (default) aborts what runs, ``in_place`` and
        ``retract`` stop the schedulers where they are."""
        try:
            body = await self._body(request) if request.can_read_body else {}
        except BadRequestError as err:
            return _json({"error": str(err)}, 400)
        mode = body.get("mode", "abort") if isinstance(body, dict) else None
        if mode not in {"abort", "retract", "in_place"}:
            return _json({"error": f"mode must be abort, retract or in_place, got {mode!r}"}, 400)
        self.health_state.pause(True)
        if mode == "abort":
            for task in list(self.worker.tasks.values()):
                task.cancel()
        else:
            self._paused_in_place = True
            self._apply_schedulers()
        return _json({"message": "Generation paused successfully.", "status": "ok"})

    async def continue_generation(self, request: web.Request) -> web.Response:
        self._paused_in_place = False
        self._apply_schedulers()
        self.health_state.pause(False)
        return _json({"message": "Generation continued successfully.", "status": "ok"})

    async def metrics(self, request: web.Request) -> web.Response:
        if not self.cfg.enable_metrics:
            return web.Response(status=404, text="Metrics are disabled; start with --enable-metrics")
        self.worker.metrics.gen_throughput.set(self.worker.gen_throughput())
        return web.Response(body=self.worker.metrics.render(), content_type="text/plain", charset="utf-8")

    async def faults(self, request: web.Request) -> web.Response:
        """Fault injection at runtime. On a prefill: ``transfer_failure_prob`` (SGLANG_TEST_DISAGG_FAILURE_PROB),
        limited to sends to the decode sessions in ``to_sessions`` when given (a broken link between this prefill and
        one decode). On a worker with decode KV offload: ``offload_race`` switches ``--sim-inject-offload-race``
        (a decode that starts or stops garbling). ``hang`` stops every scheduler of the node, or lets it go on."""
        try:
            body = await request.json()
            if isinstance(body, dict) and set(body) == {"hang"} and isinstance(body["hang"], bool):
                self.hang(body["hang"])
                return _json({"hang": body["hang"]})
            if isinstance(body, dict) and set(body) == {"offload_race"} and isinstance(body["offload_race"], bool):
                return self._switch_race(body["offload_race"])
            prob = float(body["transfer_failure_prob"])
            sessions = frozenset(str(s) for s in body.get("to_sessions", []))
        except (ValueError, KeyError, TypeError, AttributeError, json.JSONDecodeError) as err:
            expected = "{'transfer_failure_prob': float, 'to_sessions'?: [str]}, {'offload_race': bool}, {'hang': bool}"
            return _json({"error": f"expected {expected}: {err!r}"}, 400)
        if not 0.0 <= prob <= 1.0 or not self.worker.prefill_ranks:
            return _json({"error": "transfer_failure_prob must be in [0, 1], on a prefill worker"}, 400)
        for rank in self.worker.prefill_ranks:
            rank.failure_prob = prob
            rank.failure_sessions = sessions
        return _json({"transfer_failure_prob": prob, "to_sessions": sorted(sessions)})

    def _switch_race(self, on: bool) -> web.Response:
        if not self.cfg.offload or not self.worker.engines:
            need = "offload_race needs a decode with --disaggregation-decode-enable-offload-kvcache"
            return _json({"error": need}, 400)
        for engine in self.worker.engines.values():
            engine.offload_race = on
        return _json({"offload_race": on})


async def cancel_all(tasks: dict[str, asyncio.Task[Any]]) -> None:
    for task in list(tasks.values()):
        task.cancel()
    for task in list(tasks.values()):
        with contextlib.suppress(asyncio.CancelledError, Exception):
            await task
