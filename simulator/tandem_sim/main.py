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
from tandem.sglang_args import SGLANG_HTTP_BACKLOG
from tandem_sim.config import ConfigError, SimConfig, parse
from tandem_sim.http.server import Server, cancel_all
from tandem_sim.metrics import Metrics
from tandem_sim.model.weights import LoadFlagError
from tandem_sim.pd.bootstrap import BootstrapServer
from tandem_sim.pd.loader import Loader, LoadError
from tandem_sim.pd.mooncake_ports import RDMA_NO_PORT, rdma_ranks_that_start
from tandem_sim.pd.multinode import GroupError, Rendezvous, split_addr
from tandem_sim.pd.prefill import PrefillSide
from tandem_sim.pd.rankserver import RankServer
from tandem_sim.pd.seed import PORT_IN_USE, EngineInfoBootstrap
from tandem_sim.pd.transfer import INIT_FAILED, TransferEngineError
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
    """The HTTP server, with the accept queue SGLang's has: a burst of connections larger than aiohttp's default
    (128) is queued, not dropped to a 1 s SYN retransmission."""
    runner = web.AppRunner(app, access_log=None, handle_signals=False)
    await runner.setup()
    await web.TCPSite(runner, host, port, reuse_address=True, backlog=SGLANG_HTTP_BACKLOG).start()
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


def _scheduler_died(err: RankStartError) -> None:
    log.error(f"Scheduler hit an exception: {type(err.cause).__name__}: {err.cause}", extra={"tp_rank": err.tp_rank})
    log.error(str(err))


def _rdma_ports_ok(cfg: SimConfig, host: str) -> bool:
    """Over RDMA every engine of the node needs one port of the range: each rank's PD engine, and its weight
    engine when it loads from or seeds a peer (``Loader.start_engines``). False after SGLang's error log."""
    ranks = cfg.topology.local_ranks()
    per_rank = int(cfg.mode != "null") + int(cfg.load.transfer_engine)
    if per_rank == 0 or cfg.mooncake.protocol == "tcp":
        return True
    started = rdma_ranks_that_start(cfg.mooncake, host, len(ranks) * per_rank) // per_rank
    if started == len(ranks):
        return True
    log.error(RDMA_NO_PORT, extra={"ports": cfg.mooncake.ports, "tp_rank": ranks[started].tp_rank})
    _scheduler_died(RankStartError(ranks[started].tp_rank, TransferEngineError(INIT_FAILED)))
    return False


async def _load(cfg: SimConfig, loader: Loader, stop: asyncio.Event) -> SimConfig | None:
    """The node's load phases (``pd/loader.py``); None (after SGLang's error log) when a rank fails to load, or when
    the process is stopped meanwhile."""
    try:
        loader.start_engines()
        loading = asyncio.ensure_future(loader.run())
        stopping = asyncio.ensure_future(stop.wait())
        await asyncio.wait({loading, stopping}, return_when=asyncio.FIRST_COMPLETED)
        stopping.cancel()
        if not loading.done():
            loading.cancel()
            return None
        return loading.result()
    except TransferEngineError as err:
        _scheduler_died(RankStartError(cfg.topology.local_ranks()[len(loader.rank_weights)].tp_rank, err))
    except LoadError as err:
        _scheduler_died(RankStartError(err.tp_rank, RuntimeError(str(err))))
    return None


def _start_engines(cfg: SimConfig, host: str, group: Rendezvous | None) -> Worker | None:
    """The node's ranks, each with its Mooncake engine; None (after SGLang's error log) when a rank fails."""
    try:
        return Worker(cfg, Metrics(cfg.served_model_name), host, group)
    except RankStartError as err:
        _scheduler_died(err)
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


async def _seed_bootstrap(cfg: SimConfig) -> web.AppRunner | None:
    """A seed's engine-info bootstrap server, on node 0 before the schedulers start (``pd/seed.py``); None after
    SGLang's error when its port is taken."""
    try:
        return await _site(EngineInfoBootstrap().app(), cfg.host, cfg.load.engine_info_bootstrap_port)
    except OSError:
        log.error(f"RuntimeError: {PORT_IN_USE.format(port=cfg.load.engine_info_bootstrap_port)}")
        return None


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
    if not _rdma_ports_ok(cfg, host):
        return 1
    loader = Loader(cfg, host)
    runners: list[web.AppRunner] = []
    try:
        if group is not None and cfg.node_rank > 0:
            return await _serve_other_node(cfg, group, host, worker_ready, stop, loader)
        return await _serve_node0(cfg, group, host, worker_ready, stop, loader, runners)
    finally:
        for runner in reversed(runners):
            await runner.cleanup()
        loader.close()


async def _serve_node0(
    cfg: SimConfig,
    group: Rendezvous | None,
    host: str,
    worker_ready: asyncio.Future[Worker],
    stop: asyncio.Event,
    loader: Loader,
    runners: list[web.AppRunner],
) -> int:
    """Node 0 as ``Engine._launch_subprocesses`` orders it: the seed's engine-info bootstrap server and (prefill,
    in the tokenizer manager) the PD bootstrap server listen first; the HTTP server only once every scheduler
    loaded its weights and is ready; then the status stays ``Starting`` for the warm-up request."""
    loop = asyncio.get_running_loop()
    if cfg.load.start_seed:
        if (seed_runner := await _seed_bootstrap(cfg)) is None:
            return 1
        runners.append(seed_runner)
    if cfg.mode == "prefill":
        bootstrap = BootstrapServer()
        runners.append(
            await _site(bootstrap.app(), "0.0.0.0" if cfg.host in {"0.0.0.0", "::"} else cfg.host, cfg.bootstrap_port)
        )
    if (loaded := await _load(cfg, loader, stop)) is None:
        return 0 if stop.is_set() else 1
    cfg = loaded
    worker = _start_engines(cfg, host, group)
    if worker is None:
        return 1
    worker_ready.set_result(worker)
    loop.create_task(_exit_on(worker.crashed, stop)).add_done_callback(lambda _: None)

    def ready() -> bool:
        return group is None or (group.all_connected.is_set() and not group.lost.is_set())

    warmed = asyncio.Event()
    server = Server(cfg, worker, ready, warmed=warmed.is_set)
    server.weights = loader.report()
    runners.append(await _site(server.app(), cfg.host, cfg.port))
    rank_servers = await _start_rank_servers(cfg, worker, host)
    background = _background(worker)
    if cfg.hang_after_s is not None:
        loop.call_later(cfg.hang_after_s, server.hang)

    async def warm_up() -> None:  # _execute_server_warmup: status Starting until its request passed
        await asyncio.sleep(cfg.profile.wall_s(cfg.profile.load.server_warmup_s))
        warmed.set()
        log.info(
            "The server is fired up and ready to roll!",
            extra={"mode": cfg.mode, "port": cfg.port, "ranks": len(worker.ranks), "sessions": worker.session_ids},
        )

    background.append(loop.create_task(warm_up()))
    await stop.wait()
    for task in background:
        task.cancel()
    await cancel_all(worker.tasks)
    for runner in reversed(runners):
        await runner.cleanup()
    runners.clear()
    for rank_server in rank_servers:
        await rank_server.close()
    await worker.close()
    return 1 if worker.crashed.is_set() else _exit_code(group)


async def _serve_other_node(
    cfg: SimConfig,
    group: Rendezvous,
    host: str,
    worker_ready: asyncio.Future[Worker],
    stop: asyncio.Event,
    loader: Loader,
) -> int:
    """A node > 0: once the group formed, load this node's weights, start its ranks (engines, PD endpoints) and the
    dummy health server (``launch_dummy_health_check_server`` runs after ``wait_for_ready``); its ranks then serve
    node 0's calls."""
    connected = asyncio.ensure_future(group.all_connected.wait())
    lost = asyncio.ensure_future(group.lost.wait())
    await asyncio.wait({connected, lost}, return_when=asyncio.FIRST_COMPLETED)
    connected.cancel()
    lost.cancel()
    if group.lost.is_set():
        return 1
    if (loaded := await _load(cfg, loader, stop)) is None:
        return 0 if stop.is_set() else 1
    cfg = loaded
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
    except (ConfigError, LoadFlagError) as err:
        print(f"tandem sim: error: {err}", file=sys.stderr)
        return 2
    logging.getLogger().setLevel(str(cfg.server_args.get("log_level") or "info").upper())  # SGLang's --log-level
    return uvloop.run(serve(cfg))
