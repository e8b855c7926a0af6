"""Decode side of PD (mimics SGLang 0.5.23 ``CommonKVReceiver`` / ``MooncakeKVManager`` in decode mode).

For a request with bootstrap fields: fetch the prefill's layout and the target rank from its bootstrap server
(``GET /route``), register this process's Mooncake session and KV pool with that rank once, hand over the
room's destination pages, and wait for the KV (``SGLANG_DISAGGREGATION_WAITING_TIMEOUT``). Hand-overs and their
outcomes travel as small messages over one websocket per prefill rank (SGLang pushes them over one ZMQ socket),
so a room costs no HTTP request of its own. A heartbeat polls
every known prefill's bootstrap ``/health``; after ``SGLANG_DISAGGREGATION_HEARTBEAT_MAX_FAILURE`` misses the
prefill is dropped and its in-flight rooms fail with SGLang's "Lost connection with prefill instance" reason.
A transport error on the hand-over itself does not fail the room (SGLang's ZMQ push does not notice either);
the heartbeat or the waiting timeout does.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import time
from dataclasses import dataclass, field

import aiohttp
import orjson

from tandem_sim.config import SimConfig
from tandem_sim.kvpool import PagedPool
from tandem_sim.metrics import Metrics
from tandem_sim.transfer import MooncakeTransfer

log = logging.getLogger("tandem_sim.decode")
PD_PATH = "/tandem/pd"
MAX_MESSAGE = 64 * 1024 * 1024  # a hand-over lists the room's destination pages


class KVTransferError(RuntimeError):
    """SGLang's ``KVTransferError``: str() is ``KVTransferError(bootstrap_room=R): reason``."""

    def __init__(self, room: int, reason: str) -> None:
        super().__init__(reason)
        self.room = room
        self.reason = reason

    def __str__(self) -> str:
        return f"KVTransferError(bootstrap_room={self.room}): {self.reason}"


@dataclass
class PrefillPeer:
    bootstrap_addr: str
    dp_size: int
    page_size: int
    rank_urls: dict[int, str] = field(default_factory=dict)  # dp rank -> http://ip:port
    registered: set[str] = field(default_factory=set)  # rank urls this decode registered with
    rooms: dict[int, asyncio.Future[None]] = field(default_factory=dict)
    heartbeat_failures: int = 0


class DecodeSide:
    def __init__(self, cfg: SimConfig, metrics: Metrics, transfer: MooncakeTransfer, pool: PagedPool) -> None:
        self.cfg = cfg
        self.metrics = metrics
        self.transfer = transfer
        self.pool = pool
        transfer.register(pool.address, pool.nbytes)
        self.peers: dict[str, PrefillPeer] = {}
        self._sessions: dict[str, aiohttp.ClientSession] = {}
        self._peer_locks: dict[str, asyncio.Lock] = {}
        self._tasks: set[asyncio.Task[None]] = set()
        self._channels: dict[str, aiohttp.ClientWebSocketResponse] = {}
        self._channel_locks: dict[str, asyncio.Lock] = {}
        self._outcomes: dict[int, asyncio.Future[None]] = {}  # room -> KV arrived (or the failure)
        self._settled: dict[int, tuple[str, asyncio.Future[None]]] = {}  # room -> (rank url, prefill answered)
        self.waiting = 0

    def session(self, base: str) -> aiohttp.ClientSession:
        """One pooled HTTP client per peer (bootstrap server or prefill rank)."""
        sess = self._sessions.get(base)
        if sess is None or sess.closed:
            sess = aiohttp.ClientSession(
                base,
                timeout=aiohttp.ClientTimeout(total=None, sock_connect=2),
                connector=aiohttp.TCPConnector(limit=0),
            )
            self._sessions[base] = sess
        return sess

    async def close(self) -> None:
        for task in list(self._tasks):
            task.cancel()
        for ws in list(self._channels.values()):
            await ws.close()
        for sess in self._sessions.values():
            await sess.close()

    async def _peer(self, bootstrap_addr: str) -> PrefillPeer:
        lock = self._peer_locks.setdefault(bootstrap_addr, asyncio.Lock())
        async with lock:
            peer = self.peers.get(bootstrap_addr)
            if peer is not None:
                return peer
            sess = self.session(f"http://{bootstrap_addr}")
            params = {"prefill_dp_rank": "-1", "prefill_cp_rank": "-1", "target_tp_rank": "-1", "target_pp_rank": "-1"}
            try:
                async with sess.get("/route", params=params, timeout=aiohttp.ClientTimeout(total=5)) as resp:
                    if resp.status != 200:
                        raise ConnectionError(f"HTTP {resp.status}: {await resp.text()}")
                    info = await resp.json()
            except (aiohttp.ClientError, ConnectionError, TimeoutError) as err:
                raise KVTransferError(
                    -1, f"Could not fetch prefill parallel info from bootstrap_addr: {bootstrap_addr} ({err})"
                ) from None
            peer = PrefillPeer(bootstrap_addr, int(info["dp_size"]), int(info["page_size"]))
            self.peers[bootstrap_addr] = peer
            return peer

    async def _rank_url(self, peer: PrefillPeer, dp_rank: int) -> str:
        url = peer.rank_urls.get(dp_rank)
        if url is not None:
            return url
        sess = self.session(f"http://{peer.bootstrap_addr}")
        params = {"prefill_dp_rank": str(dp_rank), "prefill_cp_rank": "0", "target_tp_rank": "0", "target_pp_rank": "0"}
        async with sess.get("/route", params=params, timeout=aiohttp.ClientTimeout(total=5)) as resp:
            if resp.status != 200:
                raise ConnectionError(f"/route for dp rank {dp_rank}: HTTP {resp.status}: {await resp.text()}")
            info = await resp.json()
        url = f"http://{info['rank_ip']}:{info['rank_port']}"
        peer.rank_urls[dp_rank] = url
        if url not in peer.registered:
            body = {
                "session_id": self.transfer.session_id,
                "kv_addr": self.pool.address,
                "kv_bytes_per_token": self.pool.kv_bytes,
                "page_size": self.pool.page_size,
            }
            async with self.session(url).post(f"{PD_PATH}/register", json=body) as resp:
                if resp.status != 200:
                    raise ConnectionError(f"registration with {url}: HTTP {resp.status}: {await resp.text()}")
            peer.registered.add(url)
        return url

    async def receive_kv(self, room: int, bootstrap_host: str, bootstrap_port: int, pages: list[int]) -> None:
        """Wait until the prefill wrote this room's KV into ``pages``; raises KVTransferError."""
        addr = f"{bootstrap_host}:{bootstrap_port}"
        self.waiting += 1
        self._gauge()
        started = time.monotonic()
        try:
            try:
                peer = await self._peer(addr)
                url = await self._rank_url(peer, room % peer.dp_size)
            except KVTransferError as err:
                self.metrics.num_bootstrap_failed_reqs.inc()
                raise KVTransferError(room, err.reason) from None
            except (aiohttp.ClientError, ConnectionError, TimeoutError) as err:
                self.metrics.num_bootstrap_failed_reqs.inc()
                raise KVTransferError(room, f"Failed to bootstrap with prefill {addr}: {err}") from None
            loop = asyncio.get_running_loop()
            done: asyncio.Future[None] = loop.create_future()
            peer.rooms[room] = done
            self._outcomes[room] = done
            self._settled[room] = (url, loop.create_future())
            await self._hand_over(url, room, pages)
            try:
                await asyncio.wait_for(asyncio.shield(done), timeout=self.cfg.pd.waiting_timeout_s)
                self._settled.pop(room, None)  # the KV is in: nothing left to quiesce
            except TimeoutError:
                elapsed = time.monotonic() - started
                raise KVTransferError(
                    room, f"Request {room} timed out after {elapsed:.1f}s in KVPoll.WaitingForInput"
                ) from None
            finally:
                peer.rooms.pop(room, None)
                self._outcomes.pop(room, None)
        finally:
            self.waiting -= 1
            self._gauge()

    async def _channel(self, url: str) -> aiohttp.ClientWebSocketResponse:
        lock = self._channel_locks.setdefault(url, asyncio.Lock())
        async with lock:
            ws = self._channels.get(url)
            if ws is None or ws.closed:
                ws = await self.session(url).ws_connect(f"{PD_PATH}/ws", max_msg_size=MAX_MESSAGE, heartbeat=None)
                self._channels[url] = ws
                task = asyncio.get_running_loop().create_task(self._read_outcomes(url, ws))
                self._tasks.add(task)
                task.add_done_callback(self._tasks.discard)
            return ws

    async def _hand_over(self, url: str, room: int, pages: list[int]) -> None:
        body = {"room": room, "session_id": self.transfer.session_id, "dst_pages": pages}
        try:
            ws = await self._channel(url)
            await ws.send_bytes(orjson.dumps(body))
        except (aiohttp.ClientError, ConnectionError, RuntimeError) as err:
            log.info("hand-over to prefill broke; waiting for heartbeat", extra={"room": room, "err": str(err)})
            self._settle(room)

    async def _read_outcomes(self, url: str, ws: aiohttp.ClientWebSocketResponse) -> None:
        """Outcomes of this rank's rooms; when the channel breaks, its rooms wait for the heartbeat or timeout."""
        try:
            async for msg in ws:
                if msg.type != aiohttp.WSMsgType.BINARY:
                    continue
                reply = orjson.loads(msg.data)
                room = int(reply["room"])
                self._settle(room)
                done = self._outcomes.get(room)
                if done is None or done.done():
                    continue
                if reply.get("status") == "success":
                    done.set_result(None)
                elif reply.get("status") == "expired":
                    continue  # the prefill dropped the room; the waiting timeout fails it
                else:
                    self.metrics.num_transfer_failed_reqs.inc()
                    done.set_exception(KVTransferError(room, str(reply.get("reason", "unknown"))))
        finally:
            if self._channels.get(url) is ws:
                del self._channels[url]
            for room, (room_url, _) in list(self._settled.items()):
                if room_url == url:
                    self._settle(room)

    def _settle(self, room: int) -> None:
        entry = self._settled.get(room)
        if entry is not None and not entry[1].done():
            entry[1].set_result(None)

    async def quiesce(self, room: int, limit_s: float = 30.0) -> None:
        """Before the room's pages are reused: wait until the prefill stopped writing into them (SGLang's deferred
        decode KV release, SGLANG_DISAGGREGATION_DEFERRED_DECODE_KV_RELEASE_TIMEOUT = 30 s)."""
        entry = self._settled.pop(room, None)
        if entry is not None and not entry[1].done():
            await asyncio.wait({entry[1]}, timeout=limit_s)

    def _gauge(self) -> None:
        self.metrics.num_decode_transfer_queue_reqs.set(self.waiting)

    async def heartbeat_loop(self) -> None:
        interval = self.cfg.pd.heartbeat_interval_s
        while True:
            await asyncio.sleep(interval)
            await asyncio.gather(*(self._beat(addr) for addr in list(self.peers)))

    async def _beat(self, addr: str) -> None:
        peer = self.peers.get(addr)
        if peer is None:
            return
        ok = False
        with contextlib.suppress(aiohttp.ClientError, TimeoutError, OSError):
            timeout = aiohttp.ClientTimeout(sock_connect=2, sock_read=3)
            async with self.session(f"http://{addr}").get("/health", timeout=timeout) as resp:
                ok = resp.status == 200
        if ok:
            peer.heartbeat_failures = 0
            return
        peer.heartbeat_failures += 1
        log.info("Attempting to reconnect to prefill", extra={"bootstrap_addr": addr})
        if peer.heartbeat_failures >= self.cfg.pd.heartbeat_max_failure:
            self._drop_peer(addr)

    def _drop_peer(self, addr: str) -> None:
        peer = self.peers.pop(addr, None)
        if peer is None:
            return
        reason = f"Lost connection with prefill instance (bootstrap_addr: {addr})"
        affected = 0
        for room, fut in list(peer.rooms.items()):
            if not fut.done():
                fut.set_exception(KVTransferError(room, reason))
                affected += 1
        self.metrics.num_transfer_failed_reqs.inc(affected)
        log.error(f"{reason}, {affected} requests affected")
        for url in peer.rank_urls.values():
            sess = self._sessions.pop(url, None)
            if sess is not None:
                asyncio.get_running_loop().create_task(sess.close())

    def internal_state(self) -> dict[str, object]:
        return {
            "session_id": self.transfer.session_id,
            "prefill_peers": sorted(self.peers),
            "prefill_dp_ranks": sorted({rank for peer in self.peers.values() for rank in peer.rank_urls}),
            "num_decode_transfer_queue_reqs": self.waiting,
        }
