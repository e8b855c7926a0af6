"""``tandem sim``: the simulated SGLang 0.5.23 worker, a drop-in for ``python -m sglang.launch_server``."""

from __future__ import annotations

import asyncio
import contextlib
import logging
import signal
import socket
import sys
from collections.abc import Sequence

import aiohttp
import uvloop
from aiohttp import web

from tandem import logs
from tandem_sim.bootstrap import BootstrapServer
from tandem_sim.config import ConfigError, SimConfig, parse
from tandem_sim.metrics import Metrics
from tandem_sim.multinode import Rendezvous
from tandem_sim.server import Server, cancel_all
from tandem_sim.worker import Worker

log = logging.getLogger("tandem_sim")


def rank_host(cfg: SimConfig) -> str:
    """The address peers reach this process at (SGLang's ``get_local_ip_auto`` for wildcard binds)."""
    if cfg.host not in {"0.0.0.0", "::", ""}:
        return cfg.host
    with contextlib.suppress(OSError):
        return socket.gethostbyname(socket.gethostname())
    return "127.0.0.1"


async def _site(app: web.Application, host: str, port: int) -> web.AppRunner:
    runner = web.AppRunner(app, access_log=None, handle_signals=False)
    await runner.setup()
    await web.TCPSite(runner, host, port, reuse_address=True).start()
    return runner


async def _register_prefill_ranks(cfg: SimConfig, host: str) -> None:
    """``PUT /route`` for every attention-DP rank this process simulates (one TP rank per DP group)."""
    # The bootstrap server listens on --host (all interfaces for a wildcard): register where it listens.
    bootstrap_host = "127.0.0.1" if cfg.host in {"0.0.0.0", "::", ""} else cfg.host
    url = f"http://{bootstrap_host}:{cfg.bootstrap_port}/route"
    async with aiohttp.ClientSession() as sess:
        for dp_rank in range(cfg.attn_dp_size):
            body = {
                "attn_tp_size": 1,
                "attn_tp_rank": 0,
                "attn_cp_size": 1,
                "attn_cp_rank": 0,
                "attn_dp_size": cfg.attn_dp_size,
                "attn_dp_rank": dp_rank,
                "pp_size": 1,
                "pp_rank": 0,
                "system_dp_size": 1,
                "system_dp_rank": 0,
                "rank_ip": host,
                "rank_port": cfg.port,
                "page_size": cfg.page_size,
                "kv_cache_dtype": "auto",
                "prefill_http_port": cfg.port,
                "load_balance_method": "follow_bootstrap_room",
            }
            async with sess.put(url, json=body) as resp:
                if resp.status != 200:
                    raise RuntimeError(f"bootstrap registration failed: HTTP {resp.status} {await resp.text()}")


async def _dummy_health(cfg: SimConfig, group: Rendezvous) -> web.AppRunner:
    async def health(request: web.Request) -> web.Response:
        return web.Response(status=200 if group.all_connected.is_set() and not group.lost.is_set() else 503)

    app = web.Application()
    app.router.add_get("/health", health)
    app.router.add_get("/health_generate", health)
    return await _site(app, cfg.host, cfg.port)


async def serve(cfg: SimConfig) -> int:
    stop = asyncio.Event()
    loop = asyncio.get_running_loop()
    for sig in (signal.SIGTERM, signal.SIGINT):
        loop.add_signal_handler(sig, stop.set)
    group = None
    if cfg.nnodes > 1:
        group = Rendezvous(cfg.nnodes, cfg.node_rank, cfg.dist_init_addr or "")
        await group.start()
        background_exit = loop.create_task(_exit_on(group.lost, stop))
        background_exit.add_done_callback(lambda _: None)
    runners: list[web.AppRunner] = []
    background: list[asyncio.Task[None]] = []
    if group is not None and cfg.node_rank > 0:
        runners.append(await _dummy_health(cfg, group))
        log.info("non-zero rank: serving dummy health only", extra={"node_rank": cfg.node_rank, "port": cfg.port})
        await stop.wait()
        for runner in runners:
            await runner.cleanup()
        return 1 if group.lost.is_set() else 0
    metrics = Metrics(cfg.served_model_name)
    host = rank_host(cfg)
    worker = Worker(cfg, metrics, host)

    def ready() -> bool:
        return group is None or (group.all_connected.is_set() and not group.lost.is_set())

    server = Server(cfg, worker, ready)
    if cfg.mode == "prefill":
        bootstrap = BootstrapServer()
        runners.append(
            await _site(bootstrap.app(), "0.0.0.0" if cfg.host in {"0.0.0.0", "::"} else cfg.host, cfg.bootstrap_port)
        )
    runners.append(await _site(server.app(), cfg.host, cfg.port))
    if worker.prefill is not None:
        await _register_prefill_ranks(cfg, host)
        background.append(loop.create_task(worker.prefill.probe_loop()))
    if worker.decode is not None:
        background.append(loop.create_task(worker.decode.heartbeat_loop()))
    log.info(
        "The server is fired up and ready to roll!",
        extra={"mode": cfg.mode, "port": cfg.port, "session": worker.transfer.session_id if worker.transfer else None},
    )
    await stop.wait()
    for task in background:
        task.cancel()
    await cancel_all(worker.tasks)
    for runner in reversed(runners):
        await runner.cleanup()
    await worker.close()
    return 1 if group is not None and group.lost.is_set() else 0


async def _exit_on(event: asyncio.Event, stop: asyncio.Event) -> None:
    await event.wait()
    stop.set()


def main(argv: Sequence[str]) -> int:
    logs.setup("info", "tandem_sim")
    try:
        cfg = parse(argv)
    except ConfigError as err:
        print(f"tandem sim: error: {err}", file=sys.stderr)
        return 2
    logging.getLogger().setLevel(str(cfg.server_args.get("log_level") or "info").upper())  # SGLang's --log-level
    return uvloop.run(serve(cfg))
