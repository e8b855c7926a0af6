"""The PD hand-over endpoint of one prefill rank (SGLang's per-rank ZMQ PULL socket, here HTTP + a websocket).

Each prefill TP rank binds its own port on the rank's IP (``get_zmq_socket_on_host`` in ``CommonKVManager.__init__``
binds a random port) and registers ``rank_ip``/``rank_port`` with the bootstrap server. Decode ranks register their
KV args there (``POST /tandem/pd/register``, SGLang's ``KVArgsRegisterInfo`` message) and hand rooms over on one
websocket per decode rank (``GET /tandem/pd/ws``, SGLang's ``TransferInfo`` messages); the outcome of each room
comes back on the same websocket.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import socket
from typing import Any

import aiohttp
import orjson
from aiohttp import web

from tandem_sim.pd.decode import MAX_MESSAGE, PD_PATH
from tandem_sim.pd.prefill import DecodeRegistration, HandOver, PrefillSide, RoomExpiredError


def _json(doc: Any, status: int = 200) -> web.Response:
    return web.Response(body=orjson.dumps(doc), status=status, content_type="application/json")


def parse_registration(body: Any) -> DecodeRegistration:
    return DecodeRegistration(
        str(body["session_id"]),
        int(body["kv_addr"]),
        int(body["row_bytes"]),
        int(body["page_size"]),
        int(body["tp_rank"]),
        int(body["attn_tp_size"]),
        int(body["kv_heads"]),
    )


def parse_hand_over(body: Any) -> tuple[int, HandOver]:
    return int(body["room"]), HandOver(
        str(body["session_id"]),
        [int(p) for p in body["dst_pages"]],
        int(body["required_dst_info_num"]),
        bool(body["is_dummy"]),
    )


class RankServer:
    """Serves one prefill rank's hand-overs on its own port."""

    def __init__(self, prefill: PrefillSide) -> None:
        self.prefill = prefill
        self._channels: set[web.WebSocketResponse] = set()
        self._runner: web.AppRunner | None = None
        self.port = 0

    async def start(self, host: str) -> None:
        app = web.Application(client_max_size=MAX_MESSAGE)
        app.router.add_post(f"{PD_PATH}/register", self.register)
        app.router.add_get(f"{PD_PATH}/ws", self.channel)
        app.on_shutdown.append(self._close_channels)
        family = socket.AF_INET6 if ":" in host else socket.AF_INET
        sock = socket.socket(family, socket.SOCK_STREAM)
        sock.bind((host, 0))
        self.port = int(sock.getsockname()[1])
        self._runner = web.AppRunner(app, access_log=None, handle_signals=False)
        await self._runner.setup()
        await web.SockSite(self._runner, sock).start()

    async def close(self) -> None:
        if self._runner is not None:
            await self._runner.cleanup()

    async def _close_channels(self, app: web.Application) -> None:
        """Hand-over channels stay open for the decode's life: close them so shutdown does not wait on them."""
        for ws in list(self._channels):
            await ws.close(code=aiohttp.WSCloseCode.GOING_AWAY, message=b"prefill shutting down")

    async def register(self, request: web.Request) -> web.Response:
        try:
            reg = parse_registration(await request.json())
        except (ValueError, KeyError, TypeError, json.JSONDecodeError) as err:
            return _json({"error": f"bad registration: {err!r}"}, 400)
        self.prefill.register_decode(reg)
        return _json({"status": "ok"})

    async def channel(self, request: web.Request) -> web.WebSocketResponse:
        """One decode rank's hand-over channel: hand-overs in, ``{room, status[, reason | first_token_variant]}``
        out (a success carries the variant of the prefill batch that computed the first token:
        ``model/numerics.py``)."""
        ws = web.WebSocketResponse(max_msg_size=MAX_MESSAGE, heartbeat=None)
        await ws.prepare(request)
        tasks: set[asyncio.Task[None]] = set()
        self._channels.add(ws)
        try:
            async for msg in ws:
                if msg.type != aiohttp.WSMsgType.BINARY:
                    continue
                try:
                    room, hand_over = parse_hand_over(orjson.loads(msg.data))
                except (ValueError, KeyError, TypeError, orjson.JSONDecodeError) as err:
                    await ws.close(
                        code=aiohttp.WSCloseCode.UNSUPPORTED_DATA, message=f"bad hand-over: {err!r}".encode()
                    )
                    break
                task = asyncio.get_running_loop().create_task(self._answer(ws, room, hand_over))
                tasks.add(task)
                task.add_done_callback(tasks.discard)
        finally:
            self._channels.discard(ws)
        return ws

    async def _answer(self, ws: web.WebSocketResponse, room: int, hand_over: HandOver) -> None:
        reply: dict[str, Any] = {"room": room}
        try:
            reason, first = await self.prefill.await_transfer(room, hand_over)
        except RoomExpiredError:
            reply["status"] = "expired"  # settles the room; the decode fails it on its own timeout
        else:
            reply.update({"status": "success"} if reason is None else {"status": "failed", "reason": reason})
            if reason is None and first is not None:
                reply["first_token_variant"] = first.to_json()
        with contextlib.suppress(ConnectionError, RuntimeError):
            await ws.send_bytes(orjson.dumps(reply))
