"""``tandem sim``: the simulated SGLang 0.5.23 worker, a drop-in for ``python -m sglang.launch_server``."""

from __future__ import annotations

import asyncio
import contextlib
import logging
import signal
import socket
import sys
from collections.abc import Sequence
from typing import Any

import aiohttp
import uvloop
from aiohttp import web

from tandem import logs
from tandem_sim.bootstrap import BootstrapServer
from tandem_sim.config import ConfigError, SimConfig, parse
from tandem_sim.metrics import Metrics
from tandem_sim.mooncake_ports import RDMA_NO_PORT, rdma_ranks_that_start
from tandem_sim.multinode import GroupError, Rendezvous, split_addr
from tandem_sim.prefill import PrefillSide
from tandem_sim.rankserver import RankServer
from tandem_sim.server import Server, cancel_all
from tandem_sim.transfer import INIT_FAILED, TransferEngineError
from tandem_sim.worker import RankStartError, Worker

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


async def _register_prefill_rank(cfg: SimConfig, prefill: PrefillSide, host: str, rank_port: int) -> None:
    """``PUT /route`` for one prefill rank (``CommonKVManager.register_to_bootstrap``): on a multi-node server the
    bootstrap server runs on node 0, at the ``--dist-init-addr`` host. 5 tries with backoff, then an error log,
    as ``_register_topology_row`` does (the bootstrap server then never becomes ready)."""
    if cfg.dist_init_addr and cfg.nnodes > 1:
        bootstrap_host = split_addr(cfg.dist_init_addr)[0]
    else:  # the bootstrap server listens on --host (all interfaces for a wildcard): register where it listens
        bootstrap_host = {"0.0.0.0": "127.0.0.1", "::": "::1", "": "127.0.0.1"}.get(cfg.host, cfg.host)
    url = f"http://{bootstrap_host}:{cfg.bootstrap_port}/route"
    rank, layout = prefill.rank, prefill.layout
    body = {
        "attn_tp_size": layout.attn_tp,
        "attn_tp_rank": rank.attn_tp_rank,
        "attn_cp_size": 1,
        "attn_cp_rank": 0,
        "attn_dp_size": cfg.attn_dp_size,
        "attn_dp_rank": rank.attn_dp_rank,
        "pp_size": 1,
        "pp_rank": 0,
        "system_dp_size": 1,
        "system_dp_rank": 0,
        "rank_ip": host,
        "rank_port": rank_port,
        "page_size": cfg.page_size,
        "kv_cache_dtype": "auto",
        "prefill_http_port": cfg.port,
        "load_balance_method": "follow_bootstrap_room",
    }
    async with aiohttp.ClientSession(timeout=aiohttp.ClientTimeout(total=5)) as sess:
        for attempt in range(5):
            with contextlib.suppress(aiohttp.ClientError, TimeoutError, OSError):
                async with sess.put(url, json=body) as resp:
                    if resp.status == 200:
                        return
            if attempt < 4:
                await asyncio.sleep(min(2.0**attempt, 30.0))
    log.error(
        "Prefill instance failed to register to bootstrap server after 5 retries", extra={"tp_rank": rank.tp_rank}
    )


async def _dummy_health(cfg: SimConfig, group: Rendezvous) -> web.AppRunner:
    """SGLang's ``launch_dummy_health_check_server`` on nodes > 0."""

    async def health(request: web.Request) -> web.Response:
        return web.Response(status=200 if group.all_connected.is_set() and not group.lost.is_set() else 503)

    app = web.Application()
    for path in ("/health", "/health_generate", "/ping"):
        app.router.add_get(path, health)
    return await _site(app, cfg.host, cfg.port)


def _start_engines(cfg: SimConfig, host: str, group: Rendezvous | None) -> Worker | None:
    """The node's ranks, each with its Mooncake engine; None (after SGLang's error log) when a rank fails."""
    ranks = cfg.topology.local_ranks()
    try:
        if cfg.mode != "null" and cfg.mooncake.protocol != "tcp":
            started = rdma_ranks_that_start(cfg.mooncake, host, len(ranks))
            if started < len(ranks):
                log.error(RDMA_NO_PORT, extra={"ports": cfg.mooncake.ports, "tp_rank": ranks[started].tp_rank})
                raise RankStartError(ranks[started].tp_rank, TransferEngineError(INIT_FAILED))
        return Worker(cfg, Metrics(cfg.served_model_name), host, group)
    except RankStartError as err:
        log.error(
            f"Scheduler hit an exception: {type(err.cause).__name__}: {err.cause}", extra={"tp_rank": err.tp_rank}
        )
        log.error(str(err))
        return None


async def _start_rank_servers(cfg: SimConfig, worker: Worker, host: str) -> list[RankServer]:
    servers = []
    for prefill in worker.prefill_ranks:
        server = RankServer(prefill)
        await server.start(host)
        servers.append(server)
    await asyncio.gather(*(_register_prefill_rank(cfg, s.prefill, host, s.port) for s in servers))
    return servers


def _background(worker: Worker) -> list[asyncio.Task[None]]:
    loop = asyncio.get_running_loop()
    loops = [loop.create_task(p.probe_loop()) for p in worker.prefill_ranks]
    return loops + [loop.create_task(d.heartbeat_loop()) for d in worker.decode_ranks]


async def serve(cfg: SimConfig) -> int:
    stop = asyncio.Event()
    loop = asyncio.get_running_loop()
    for sig in (signal.SIGTERM, signal.SIGINT):
        loop.add_signal_handler(sig, stop.set)
    host = rank_host(cfg)
    group = None
    worker_ready: asyncio.Future[Worker] = loop.create_future()
    if cfg.nnodes > 1:

        async def on_call(message: dict[str, Any]) -> dict[str, Any]:
            return await (await worker_ready).serve_call(message)

        group = Rendezvous(cfg.nnodes, cfg.node_rank, cfg.dist_init_addr or "", cfg.dist_timeout_s, on_call)
        try:
            await group.start()
        except GroupError as err:
            log.error(str(err))
            return 1
        loop.create_task(_exit_on(group.lost, stop)).add_done_callback(lambda _: None)
    if group is not None and cfg.node_rank > 0:
        return await _serve_other_node(cfg, group, host, worker_ready, stop)
    worker = _start_engines(cfg, host, group)
    if worker is None:
        return 1
    worker_ready.set_result(worker)
    loop.create_task(_exit_on(worker.crashed, stop)).add_done_callback(lambda _: None)

    def ready() -> bool:
        return group is None or (group.all_connected.is_set() and not group.lost.is_set())

    server = Server(cfg, worker, ready)
    runners: list[web.AppRunner] = []
    if cfg.mode == "prefill":
        bootstrap = BootstrapServer()
        runners.append(
            await _site(bootstrap.app(), "0.0.0.0" if cfg.host in {"0.0.0.0", "::"} else cfg.host, cfg.bootstrap_port)
        )
    runners.append(await _site(server.app(), cfg.host, cfg.port))
    rank_servers = await _start_rank_servers(cfg, worker, host)
    background = _background(worker)
    if cfg.hang_after_s is not None:
        loop.call_later(cfg.hang_after_s, server.hang)
    log.info(
        "The server is fired up and ready to roll!",
        extra={"mode": cfg.mode, "port": cfg.port, "ranks": len(worker.ranks), "sessions": worker.session_ids},
    )
    await stop.wait()
    for task in background:
        task.cancel()
    await cancel_all(worker.tasks)
    for runner in reversed(runners):
        await runner.cleanup()
    for rank_server in rank_servers:
        await rank_server.close()
    await worker.close()
    return 1 if worker.crashed.is_set() else _exit_code(group)


async def _serve_other_node(
    cfg: SimConfig, group: Rendezvous, host: str, worker_ready: asyncio.Future[Worker], stop: asyncio.Event
) -> int:
    """A node > 0: once the group formed, start this node's ranks (engines, PD endpoints) and the dummy health
    server; its ranks then serve node 0's calls."""
    connected = asyncio.ensure_future(group.all_connected.wait())
    lost = asyncio.ensure_future(group.lost.wait())
    await asyncio.wait({connected, lost}, return_when=asyncio.FIRST_COMPLETED)
    connected.cancel()
    lost.cancel()
    if group.lost.is_set():
        return 1
    worker = _start_engines(cfg, host, group)
    if worker is None:
        return 1
    worker_ready.set_result(worker)
    loop = asyncio.get_running_loop()
    loop.create_task(_exit_on(worker.crashed, stop)).add_done_callback(lambda _: None)
    runner = await _dummy_health(cfg, group)
    rank_servers = await _start_rank_servers(cfg, worker, host)
    background = _background(worker)
    log.info(
        "non-zero rank: serving dummy health only",
        extra={"node_rank": cfg.node_rank, "port": cfg.port, "sessions": worker.session_ids},
    )
    await stop.wait()
    for task in background:
        task.cancel()
    await runner.cleanup()
    for rank_server in rank_servers:
        await rank_server.close()
    await worker.close()
    return 1 if worker.crashed.is_set() else _exit_code(group)


def _exit_code(group: Rendezvous | None) -> int:
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
