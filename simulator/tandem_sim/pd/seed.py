"""SGLang 0.5.23's remote-instance weight protocol over the transfer engine: how a seed publishes each rank's
weight buffers and how a new instance finds them.

Seed side (``--remote-instance-weight-loader-start-seed-via-transfer-engine``):

- Node 0 starts the engine-info bootstrap server on ``--host``:``--engine-info-bootstrap-port`` (6789) before its
  schedulers (``entrypoints/engine.py``: ``Engine._launch_subprocesses``; a port in use is a ``RuntimeError``, the
  launch fails). It keeps ``{tp_rank: (session_id, weights_info_dict)}``: ``PUT /register_transfer_engine_info``,
  ``GET /get_transfer_engine_info?rank=`` (404 "No transfer engine info for rank N" until that rank registered),
  ``GET /health`` (``entrypoints/engine_info_bootstrap_server.py``: ``EngineInfoBootstrapServer``).
- Each rank, right after loading its weights, registers them with its own transfer engine and ``PUT``s its session
  id (``ip:rpc_port``) and ``{name: (data_ptr, numel, element_size)}`` there, at 127.0.0.1 on one node or at the
  ``--dist-init-addr`` host on several; a failure is only logged (``model_runner_components/
  remote_instance_weight_transporter.py``: ``maybe_register_and_publish_weight_info``,
  ``_register_to_engine_info_bootstrap``). A rank that itself loaded from a peer has its ``weight_info`` set by the
  loader and so never publishes (the same function's ``self.weight_info is None`` check).
- The seed's HTTP server answers ``GET /remote_instance_transfer_engine_info?rank=N`` (and the deprecated
  ``/get_remote_instance_transfer_engine_info``, which logs a warning) by asking its bootstrap server, 5 s timeout
  (``entrypoints/http_server.py``: ``remote_instance_transfer_engine_info``): the bootstrap's JSON, else 400.

New instance side: ``model_loader/remote_instance_weight_loader_utils.py``:
``get_remote_instance_transfer_engine_info_per_rank`` (``GET {seed}/get_remote_instance_transfer_engine_info``,
no timeout; any failure is logged and gives ``(None, None)``).
"""

from __future__ import annotations

import contextlib
import logging
from collections.abc import Awaitable, Callable

import aiohttp
from aiohttp import web

log = logging.getLogger("tandem_sim.seed")

WeightInfo = dict[str, list[int]]  # name -> [data_ptr, numel, element_size]
PORT_IN_USE = (
    "engine_info_bootstrap_port {port} is already in use. When running multiple instances on the same node, each "
    "instance must use a different --engine-info-bootstrap-port."
)


def loopback(host: str) -> str:
    """``ServerArgs.url``: a wildcard bind is reached on loopback."""
    return {"": "127.0.0.1", "0.0.0.0": "127.0.0.1", "::": "[::1]"}.get(host, f"[{host}]" if ":" in host else host)


class EngineInfoBootstrap:
    """``EngineInfoBootstrapServer``: per-rank transfer-engine info of a seed."""

    def __init__(self) -> None:
        self.info: dict[int, tuple[str, WeightInfo]] = {}

    def app(self) -> web.Application:
        app = web.Application()
        app.router.add_get("/health", self._health)
        app.router.add_put("/register_transfer_engine_info", self._register)
        app.router.add_get("/get_transfer_engine_info", self._get)
        return app

    async def _health(self, request: web.Request) -> web.Response:
        return web.Response(text="OK")

    async def _register(self, request: web.Request) -> web.Response:
        try:
            data = await request.json()
            info = data["transfer_engine_info"]
            tp_rank = int(data["tp_rank"])
            self.info[tp_rank] = (str(info["session_id"]), dict(info["weights_info_dict"]))
        except (ValueError, KeyError, TypeError) as err:
            log.error(f"Failed to register engine info: {err}")
            return web.json_response({"detail": str(err)}, status=400)
        log.info(f"Registered transfer engine info for tp_rank={tp_rank}, session_id={info['session_id']}")
        return web.Response(text="OK")

    async def _get(self, request: web.Request) -> web.Response:
        try:
            rank = int(request.query["rank"])
        except (KeyError, ValueError):
            return web.json_response({"detail": "rank: an integer is required"}, status=422)
        if rank < 0:
            return web.json_response({"detail": "Invalid rank parameter"}, status=400)
        if (info := self.info.get(rank)) is None:
            return web.json_response({"detail": f"No transfer engine info for rank {rank}"}, status=404)
        return web.json_response({"rank": rank, "remote_instance_transfer_engine_info": list(info)})


async def publish(bootstrap_host: str, port: int, tp_rank: int, session_id: str, weights: WeightInfo) -> None:
    """A seed rank's ``PUT /register_transfer_engine_info`` (5 s timeout; failures are logged, not raised)."""
    url = f"http://{loopback(bootstrap_host)}:{port}/register_transfer_engine_info"
    payload = {"tp_rank": tp_rank, "transfer_engine_info": {"session_id": session_id, "weights_info_dict": weights}}
    try:
        async with (
            aiohttp.ClientSession(timeout=aiohttp.ClientTimeout(total=5)) as sess,
            sess.put(url, json=payload) as resp,
        ):
            if resp.status == 200:
                log.info(f"Registered transfer engine info for tp_rank={tp_rank} with bootstrap server at {url}")
            else:
                log.error(
                    f"Failed to register transfer engine info for tp_rank={tp_rank}: {resp.status}, {await resp.text()}"
                )
    except (aiohttp.ClientError, OSError, TimeoutError) as err:
        log.error(f"Failed to register transfer engine info for tp_rank={tp_rank}: {err}")


def info_handler(
    host: str, bootstrap_port: int, *, deprecated: bool
) -> Callable[[web.Request], Awaitable[web.Response]]:
    """The seed HTTP server's ``/remote_instance_transfer_engine_info`` (or its deprecated alias)."""
    url = f"http://{loopback(host)}:{bootstrap_port}/get_transfer_engine_info"

    async def handler(request: web.Request) -> web.Response:
        if deprecated:
            log.warning(
                "Endpoint '/get_remote_instance_transfer_engine_info' is deprecated and will be removed in a future "
                "version. Please use '/remote_instance_transfer_engine_info' instead."
            )
        rank = -1
        with contextlib.suppress(KeyError, ValueError):
            rank = int(request.query["rank"])
        if rank < 0:
            return web.json_response({"error": {"message": "Missing or invalid rank parameter"}}, status=400)
        try:
            async with (
                aiohttp.ClientSession(timeout=aiohttp.ClientTimeout(total=5)) as sess,
                sess.get(url, params={"rank": rank}) as resp,
            ):
                if resp.status == 200:
                    return web.json_response(await resp.json())
        except (aiohttp.ClientError, OSError, TimeoutError, ValueError) as err:
            log.warning(f"Failed to get transfer engine info for rank {rank}: {err}")
        return web.json_response(
            {"error": {"message": f"Failed to get transfer engine info for rank {rank}"}}, status=400
        )

    return handler


async def fetch_info(seed_url: str, tp_rank: int) -> tuple[str, WeightInfo] | None:
    """``get_remote_instance_transfer_engine_info_per_rank``: the seed rank's (session id, weight info), or None
    after SGLang's error log."""
    try:
        async with (
            aiohttp.ClientSession(timeout=aiohttp.ClientTimeout(total=None)) as sess,
            sess.get(f"{seed_url}/get_remote_instance_transfer_engine_info", params={"rank": tp_rank}) as resp,
        ):
            if resp.status != 200:
                log.error(f"request.get failed: {resp.status}")
                return None
            data = await resp.json()
    except (aiohttp.ClientError, OSError, ValueError) as err:
        log.error(f"Exception: {err}")
        return None
    if "remote_instance_transfer_engine_info" not in data:
        log.error("Failed to get `remote_instance_transfer_engine_info` in response.")
        return None
    session_id, weights = data["remote_instance_transfer_engine_info"]
    return str(session_id), dict(weights)
