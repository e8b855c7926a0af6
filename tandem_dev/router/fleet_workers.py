"""Many cheap SGLang-shaped PD workers in one process: a fleet of hundreds of prefills and decodes on loopback, so
the router's per-fleet costs (health checks, canary probing, integrity state) can be measured at 125 x 125 on a
2-core machine, where 250 simulator processes would not fit.

``python -m tandem_dev.router.fleet_workers --prefills 125 --decodes 125 --base-port 20000 --etcd-endpoint H:P``

Ports: prefill ``i`` on ``base + i``, decode ``j`` on ``base + P + j``, prefill ``i``'s bootstrap port on
``base + P + D + i`` (bound, so nothing else takes it; it answers nothing useful). One aiohttp runner serves
every port and finds the worker by the local port of the connection: one event loop, one application, no
per-worker tasks. With ``--etcd-endpoint`` every worker is registered as the operator registers a serving group
(``tandem.registry`` entries ``prefill-<i>`` / ``decode-<j>``, unsigned) under one lease of one
``tandem.leased_writer.LeasedWriter``; ``GET /_fleet`` answers 200 once all are registered (503 before).

What is modelled:

* The PD handshake: both workers check the bootstrap fields (``instant_worker._bootstrap_problem``); the decode
  waits (up to ``TRANSFER_TIMEOUT_S``) until the prefill named by ``bootstrap_port`` received the same
  ``bootstrap_room`` (the KV transfer), and fails the request otherwise, so a router that pairs wrongly is seen.
* Answers deterministic in the prompt: ``max_new_tokens`` (default 32) words drawn from a made-up vocabulary by a
  generator seeded with a hash of the prompt; tokens are whitespace words (as the simulator's tokenizer). With
  logprobs asked for, each token carries a top-2 with a margin of ``MARGIN`` nats (never a near-tie), in SGLang's
  ``/generate`` (``output_token_logprobs`` / ``output_top_logprobs`` triples) and OpenAI shapes.
* A decode's time and capacity: one token every ``--step-ms`` per running request, at most ``--max-running``
  requests at once, the rest queued; ``sglang:num_running_reqs``, ``num_queue_reqs`` and ``token_usage``
  (running / max running) on ``/metrics``, so the router's capacity learner sees a saturated decode.
* The upstream decode KV-offload race 1, as the simulator models it (simulator/tandem_sim/engine/engine.py,
  ``_maybe_offload`` with ``offload_race``): on a request's first offload (its page holding the prompt's end
  fills, pages of ``PAGE_TOKENS`` = 16 tokens as the integrity stack's decodes use, not SGLang's 64, so that
  short answers reach it) its full prompt pages go back to the allocator while it still attends to them. The
  next request admitted to the same decode while it runs takes those pages and writes its prompt there: from
  that moment the first request's output continues with the newcomer's prompt words (a prompt leak). A decode
  with one request at a time never garbles (nobody takes the pages), as in the simulator. ``--garble-decode J``
  (repeatable) starts decode ``J`` racing; ``POST /tandem/sim/faults {"offload_race": bool}`` on a decode's port
  switches it at runtime (the simulator's switch).

What is not: real KV (no bytes move), prefill compute time and capacity (a prefill answers after the fixed
``--prefill-ms``), batches (a list ``bootstrap_room`` is refused), streaming logprobs, EOS (every answer has
exactly its token budget), race 2 (host copies poisoned at finish), several thieves sharing one victim's pages
(the first newcomer takes them all), and the race's state is read when the newcomer arrives, not at the offload.

``GET /_stats`` on any port: the decodes' requests and request-seconds by class (``canary``: the router's
``canary-*`` request ids; ``integrity``: other requests asking for logprobs, i.e. shadows and probation mirrors;
``client``: the rest), and the garbled answers (``first_garbled_at``: when the first answer garbled since the race
was last switched on ended, on this machine's monotonic clock), for benchmarks that check the router's own counters.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import logging
import signal
import time
from collections import OrderedDict
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any

import orjson
import uvloop
from aiohttp import web

from tandem.leased_writer import LeasedWriter
from tandem.registry import Endpoint, Role
from tandem.registry_signing import registry_entry
from tandem_dev.router import fleet_answers as answers
from tandem_dev.router.instant_worker import MODEL, _bootstrap_problem, _health, _models

log = logging.getLogger("tandem.dev.fleet")

HOST = "127.0.0.1"
PAGE_TOKENS = 16
TRANSFER_TIMEOUT_S = 10.0
ROOMS_KEPT = 1 << 16  # rooms a prefill saw that no decode claimed yet (bounded: oldest dropped)


@dataclass(eq=False)
class Running:
    """One request on a decode: its clean answer, and the other prompt it reads from once its pages were taken."""

    prompt: list[str]
    clean: list[str]
    admitted: float
    release_at: float | None  # when its prompt pages would go back under the race; None: prompt under a page
    thief: list[str] | None = None
    garbled_from: int = 0

    def word(self, i: int) -> str:
        if self.thief is not None and i >= self.garbled_from:
            return self.thief[(i - self.garbled_from) % len(self.thief)]
        return self.clean[i]


@dataclass(eq=False)
class Worker:
    role: Role
    index: int
    port: int
    bootstrap_port: int | None = None
    race: bool = False
    running: set[Running] = field(default_factory=set)
    queued: int = 0
    slots: asyncio.Semaphore | None = None

    @property
    def group(self) -> str:
        return f"{self.role.value}-{self.index}"

    def endpoint(self) -> Endpoint:
        return Endpoint(
            role=self.role, group=self.group, url=f"http://{HOST}:{self.port}", bootstrap_port=self.bootstrap_port,
            model=MODEL,
        )  # fmt: skip


@dataclass
class Fleet:
    step_s: float
    max_running: int
    prefill_s: float
    by_port: dict[int, Worker] = field(default_factory=dict)
    by_bootstrap: dict[int, Worker] = field(default_factory=dict)
    rooms: OrderedDict[tuple[int, int], asyncio.Event] = field(default_factory=OrderedDict)
    registered: bool = False
    stats: dict[str, float] = field(default_factory=dict)

    def count(self, name: str, value: float = 1.0) -> None:
        self.stats[name] = self.stats.get(name, 0.0) + value

    def room(self, bootstrap_port: int, room: int) -> asyncio.Event:
        key = (bootstrap_port, room)
        event = self.rooms.get(key)
        if event is None:
            event = self.rooms[key] = asyncio.Event()
            while len(self.rooms) > ROOMS_KEPT:
                self.rooms.popitem(last=False)
        return event

    def admit(self, decode: Worker, prompt: list[str], tokens: int, now: float) -> Running:
        """Start ``prompt`` on ``decode`` (a slot is held). Under the race it takes the prompt pages a running
        request handed back already, if any: that request reads this prompt from its next token on."""
        full_pages = len(prompt) // PAGE_TOKENS
        release = now + (PAGE_TOKENS - len(prompt) % PAGE_TOKENS) * self.step_s if full_pages else None
        req = Running(prompt, answers.clean_words(prompt, tokens), now, release)
        if decode.race and prompt:
            for victim in decode.running:
                if victim.thief is None and victim.release_at is not None and victim.release_at <= now:
                    pages = len(victim.prompt) // PAGE_TOKENS
                    victim.thief = prompt[: pages * PAGE_TOKENS]
                    victim.garbled_from = min(len(victim.clean), int((now - victim.admitted) / self.step_s) + 1)
                    break
        decode.running.add(req)
        return req


def _error(status: int, message: str) -> web.Response:
    return web.json_response(
        {"error": {"message": message, "type": "invalid_request_error", "code": status}}, status=status
    )


_FLEET: web.AppKey[Fleet] = web.AppKey("fleet", Fleet)


def _worker(request: web.Request) -> Worker:
    sock = request.transport.get_extra_info("sockname") if request.transport is not None else None
    worker = request.app[_FLEET].by_port.get(sock[1] if sock else -1)
    if worker is None:
        raise web.HTTPNotFound(text="no worker on this port")
    return worker


async def _serve(request: web.Request) -> web.StreamResponse:
    arrived = time.monotonic()
    fleet, worker = request.app[_FLEET], _worker(request)
    body = orjson.loads(await request.read())
    problem = _bootstrap_problem(body) if isinstance(body, dict) else "body must be a JSON object"
    if problem is None and isinstance(body["bootstrap_room"], list):
        problem = "fleet workers take one request at a time (no batches)"
    prompt = answers.prompt(request.path, body) if problem is None else None
    if problem is not None or prompt is None:
        return _error(400, problem or "no prompt")
    port, room = body["bootstrap_port"], body["bootstrap_room"]
    if worker.role is Role.PREFILL:
        await asyncio.sleep(fleet.prefill_s)
        fleet.room(worker.bootstrap_port or 0, room).set()
        empty = b'{"text":"","meta_info":{"finish_reason":{"type":"length","length":0}}}'
        return web.Response(body=empty, content_type="application/json")
    if not isinstance(port, int) or port not in fleet.by_bootstrap:
        return _error(500, f"KV transfer failed: no prefill bootstrap server on port {port}")
    try:
        async with asyncio.timeout(TRANSFER_TIMEOUT_S):
            await fleet.room(port, room).wait()
    except TimeoutError:
        return _error(500, f"KV transfer failed: prefill on bootstrap port {port} never sent room {room}")
    fleet.rooms.pop((port, room), None)
    rid = request.headers.get("X-Request-Id", "")
    kind = (
        "canary"
        if rid.startswith("canary-")
        else "integrity"
        if answers.logprobs_asked(request.path, body)
        else "client"
    )
    started = time.monotonic()
    assert worker.slots is not None
    worker.queued += 1
    try:
        await worker.slots.acquire()
    finally:
        worker.queued -= 1
    req = fleet.admit(worker, prompt, answers.budget(request.path, body), time.monotonic())
    try:
        return await _answer(request, fleet, req, body, len(prompt), arrived)
    finally:
        worker.running.discard(req)
        worker.slots.release()
        fleet.count(f"{kind}_requests")
        fleet.count(f"{kind}_seconds", time.monotonic() - started)
        fleet.count("garbled", req.thief is not None)
        if req.thief is not None:
            fleet.stats.setdefault("first_garbled_at", time.monotonic())


async def _answer(
    request: web.Request, fleet: Fleet, req: Running, body: dict[str, Any], prompt_len: int, arrived: float
) -> web.StreamResponse:
    n = len(req.clean)
    if not body.get("stream"):
        await asyncio.sleep(n * fleet.step_s)
        answer, logprobs = [req.word(i) for i in range(n)], answers.logprobs_asked(request.path, body)
        full = answers.full_body(request.path, answer, prompt_len, logprobs, time.monotonic() - arrived)
        return web.Response(body=full, content_type="application/json")
    resp = web.StreamResponse(headers={"Content-Type": "text/event-stream"})
    await resp.prepare(request)
    words: list[str] = []
    for i in range(n):
        await asyncio.sleep(max(0.0, req.admitted + (i + 1) * fleet.step_s - time.monotonic()))
        words.append(req.word(i))
        await resp.write(answers.chunk(request.path, words, i))
    await resp.write(b"data: [DONE]\n\n")
    return resp


async def _metrics(request: web.Request) -> web.Response:
    fleet, w = request.app[_FLEET], _worker(request)
    running = len(w.running)
    usage = running / fleet.max_running if w.role is Role.DECODE else 0.0
    text = (
        f'# TYPE sglang:num_running_reqs gauge\nsglang:num_running_reqs{{model_name="{MODEL}"}} {running}\n'
        f'# TYPE sglang:num_queue_reqs gauge\nsglang:num_queue_reqs{{model_name="{MODEL}"}} {w.queued}\n'
        f'# TYPE sglang:token_usage gauge\nsglang:token_usage{{model_name="{MODEL}"}} {usage:.4f}\n'
    )
    return web.Response(text=text, content_type="text/plain")


async def _info(request: web.Request) -> web.Response:
    w = _worker(request)
    doc: dict[str, Any] = {"model_path": MODEL, "served_model_name": MODEL, "disaggregation_mode": w.role.value,
                           "tp_size": 1, "dp_size": 1, "is_generation": True, "version": "fleet"}  # fmt: skip
    return web.json_response(doc)


async def _faults(request: web.Request) -> web.Response:
    """The simulator's runtime switch (``/tandem/sim/faults``), for the race only."""
    w = _worker(request)
    doc: Any = orjson.loads(await request.read())
    if w.role is not Role.DECODE or not isinstance(doc, dict) or not isinstance(doc.get("offload_race"), bool):
        return _error(400, 'a decode takes {"offload_race": true|false}')
    w.race = doc["offload_race"]
    if w.race:
        request.app[_FLEET].stats.pop("first_garbled_at", None)
    log.warning("offload race switched", extra={"decode": w.group, "on": w.race})
    return web.json_response({"ok": True, "offload_race": w.race})


async def _stats(request: web.Request) -> web.Response:
    fleet = request.app[_FLEET]
    decodes = sum(w.role is Role.DECODE for w in fleet.by_port.values())
    doc = {**fleet.stats, "decodes": decodes, "max_running": fleet.max_running, "time": time.monotonic()}
    return web.json_response(doc)


async def _ready(request: web.Request) -> web.Response:
    return web.Response(text="registered", status=200 if request.app[_FLEET].registered else 503)


def build_app(fleet: Fleet) -> web.Application:
    app = web.Application()
    app[_FLEET] = fleet
    for path in ("/generate", "/v1/chat/completions", "/v1/completions"):
        app.router.add_post(path, _serve)
    for path, handler in (("/health", _health), ("/health_generate", _health), ("/v1/models", _models),
                          ("/metrics", _metrics), ("/_stats", _stats), ("/_fleet", _ready)):  # fmt: skip
        app.router.add_get(path, handler)
    for path in ("/server_info", "/get_server_info", "/model_info", "/get_model_info"):
        app.router.add_get(path, _info)
    app.router.add_post("/tandem/sim/faults", _faults)
    return app


def make_fleet(args: argparse.Namespace) -> Fleet:
    fleet = Fleet(args.step_ms / 1000, args.max_running, args.prefill_ms / 1000)
    p, d = args.prefills, args.decodes
    for i in range(p):
        w = Worker(Role.PREFILL, i, args.base_port + i, bootstrap_port=args.base_port + p + d + i)
        fleet.by_port[w.port], fleet.by_bootstrap[w.bootstrap_port or 0] = w, w
    for j in range(d):
        w = Worker(Role.DECODE, j, args.base_port + p + j, race=j in args.garble_decode)
        w.slots = asyncio.Semaphore(args.max_running)
        fleet.by_port[w.port] = w
    return fleet


async def serve(args: argparse.Namespace) -> None:
    fleet = make_fleet(args)
    runner = web.AppRunner(build_app(fleet), access_log=None, handle_signals=False)
    await runner.setup()
    ports = [*fleet.by_port, *fleet.by_bootstrap]
    for port in ports:
        await web.TCPSite(runner, HOST, port, backlog=1024).start()
    writer = LeasedWriter(args.etcd_endpoint, args.lease_ttl) if args.etcd_endpoint else None
    stop = asyncio.Event()
    loop = asyncio.get_running_loop()
    for sig in (signal.SIGTERM, signal.SIGINT):
        loop.add_signal_handler(sig, stop.set)
    try:
        if writer is not None:
            await writer.start()
            for w in fleet.by_port.values():
                await writer.put(*registry_entry(args.namespace, args.cluster, w.endpoint(), None))
        fleet.registered = True
        print(f"fleet: {args.prefills} prefills + {args.decodes} decodes on {HOST}:{min(ports)}-{max(ports)}"
              f"{' registered in etcd' if writer else ''}", flush=True)  # fmt: skip
        await stop.wait()
    finally:
        if writer is not None:
            with contextlib.suppress(Exception):
                await writer.close(revoke=True)
        await runner.cleanup()


def main(argv: Sequence[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m tandem_dev.router.fleet_workers", description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)  # fmt: skip
    p.add_argument("--prefills", type=int, default=2)
    p.add_argument("--decodes", type=int, default=2)
    p.add_argument("--base-port", type=int, required=True)
    p.add_argument("--step-ms", type=float, default=20.0, help="per-token step of a decode")
    p.add_argument("--max-running", type=int, default=8, help="requests a decode runs at once (more queue)")
    p.add_argument("--prefill-ms", type=float, default=5.0)
    p.add_argument("--garble-decode", type=int, action="append", default=[], metavar="INDEX")
    p.add_argument("--etcd-endpoint", action="append", default=[], metavar="HOST:PORT")
    p.add_argument("--namespace", default="local")
    p.add_argument("--cluster", default="tandem")
    p.add_argument("--lease-ttl", type=int, default=10)
    args = p.parse_args(argv)
    logging.basicConfig(level=logging.WARNING, format="%(asctime)s %(levelname)s %(name)s %(message)s")
    uvloop.run(serve(args))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
