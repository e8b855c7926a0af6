"""The prefill bootstrap server (SGLang 0.5.23 ``CommonKVBootstrapServer``): ``PUT/GET /route``, ``GET /health``.

Runs on prefill node 0 at ``--disaggregation-bootstrap-port``. Every prefill rank registers with ``PUT /route``;
``GET /route`` with all ranks ``-1`` answers the prefill's parallel layout once every rank registered (503
before), with concrete ranks it answers that rank's ``{rank_ip, rank_port}`` (404 if unknown).
"""

from __future__ import annotations

from typing import Any

from aiohttp import web


class BootstrapServer:
    def __init__(self) -> None:
        self.attn_tp_size: int | None = None
        self.attn_cp_size: int | None = None
        self.dp_size: int | None = None
        self.pp_size: int | None = None
        self.page_size: int | None = None
        self.kv_cache_dtype: str | None = None
        self.prefill_http_port: int | None = None
        self.follow_bootstrap_room: bool | None = None
        self.table: dict[tuple[int, int, int, int], dict[str, Any]] = {}

    def app(self) -> web.Application:
        app = web.Application()
        app.router.add_route("*", "/route", self.handle_route)
        app.router.add_get("/health", self.handle_health)
        return app

    @property
    def registered(self) -> int:
        return len(self.table)

    def is_ready(self) -> bool:
        if self.attn_tp_size is None or self.attn_cp_size is None or self.pp_size is None or self.dp_size is None:
            return False
        return self.registered >= self.dp_size * self.attn_cp_size * self.attn_tp_size * self.pp_size

    async def handle_health(self, request: web.Request) -> web.Response:
        return web.Response(text="OK")

    async def handle_route(self, request: web.Request) -> web.Response:
        if request.method == "PUT":
            return await self._put(request)
        if request.method == "GET":
            return self._get(request)
        return web.Response(text="Method not allowed", status=405, content_type="application/json")

    async def _put(self, request: web.Request) -> web.Response:
        try:
            data = await request.json()
            key = (
                int(data["attn_dp_rank"]) if int(data.get("system_dp_size", 1)) == 1 else int(data["system_dp_rank"]),
                int(data["attn_cp_rank"]),
                int(data["attn_tp_rank"]),
                int(data["pp_rank"]),
            )
            info = {"rank_ip": str(data["rank_ip"]), "rank_port": int(data["rank_port"])}
            system_dp = int(data.get("system_dp_size", 1))
            self.attn_tp_size = self.attn_tp_size or int(data["attn_tp_size"])
            self.attn_cp_size = self.attn_cp_size or int(data["attn_cp_size"])
            self.dp_size = self.dp_size or (int(data["attn_dp_size"]) if system_dp == 1 else system_dp)
            self.pp_size = self.pp_size or int(data["pp_size"])
            self.page_size = self.page_size or int(data["page_size"])
            self.kv_cache_dtype = self.kv_cache_dtype or str(data["kv_cache_dtype"])
            if data.get("prefill_http_port") is not None:
                self.prefill_http_port = self.prefill_http_port or int(data["prefill_http_port"])
            if self.follow_bootstrap_room is None:
                method = data.get("load_balance_method", "follow_bootstrap_room")
                self.follow_bootstrap_room = method == "follow_bootstrap_room"
        except (ValueError, KeyError, TypeError) as err:
            return web.Response(text=f"Bad registration: {err!r}", status=400)
        self.table[key] = info
        return web.Response(text="OK")

    def _get(self, request: web.Request) -> web.Response:
        q = request.query
        names = ("prefill_dp_rank", "prefill_cp_rank", "target_tp_rank", "target_pp_rank")
        if not all(q.get(n) for n in names):
            return web.Response(text="Missing inputs for bootstrap server.", status=400)
        try:
            ranks = tuple(int(q[n]) for n in names)
        except ValueError:
            return web.Response(text="Missing inputs for bootstrap server.", status=400)
        if not self.is_ready():
            return web.Response(
                text=f"Prefill server not fully registered yet ({self.registered} workers registered).", status=503
            )
        if ranks == (-1, -1, -1, -1):
            return web.json_response(
                {
                    "attn_tp_size": self.attn_tp_size,
                    "attn_cp_size": self.attn_cp_size,
                    "dp_size": self.dp_size,
                    "pp_size": self.pp_size,
                    "page_size": self.page_size,
                    "kv_cache_dtype": self.kv_cache_dtype,
                    "follow_bootstrap_room": True if self.follow_bootstrap_room is None else self.follow_bootstrap_room,
                    "enable_dsa_cache_layer_split": False,
                    "enable_kv_cache_sharding": False,
                    "prefill_http_port": self.prefill_http_port,
                    "decode_allocation_policy": "early",
                }
            )
        info = self.table.get(ranks)  # type: ignore[arg-type]
        if info is None:
            dp, cp, tp, pp = ranks
            return web.Response(
                text=f"Bootstrap info not found for dp_rank={dp} cp_rank={cp} tp_rank={tp} pp_rank={pp}", status=404
            )
        return web.json_response(info)
