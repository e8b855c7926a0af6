"""Decode side of PD for one GPU rank (mimics SGLang 0.5.23 ``CommonKVReceiver`` / ``MooncakeKVManager`` in decode
mode). A decode server has one ``DecodeSide`` per TP rank, each with its own transfer engine and KV pool shard.

For a request with bootstrap fields: fetch the prefill's layout from its bootstrap server (``GET /route``, all
ranks -1), map this rank to its prefill ranks as ``_resolve_rank_mapping`` does (``ranks.rank_mapping``), look each
target rank up (``GET /route`` with concrete ranks) and register this rank's Mooncake session and KV shard with it
once (``_register_kv_args``), hand over the room's destination pages to every target (dummy ones included, as
``send_metadata`` does for MLA), and wait until ``required_prefill_response_num`` real senders reported success
(``SGLANG_DISAGGREGATION_WAITING_TIMEOUT``). Hand-overs and their
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
from tandem_sim.engine.kvpool import PagedPool
from tandem_sim.metrics import Metrics
from tandem_sim.model.numerics import PrefillVariant
from tandem_sim.model.ranks import KVLayout, Rank, RankMapping, rank_mapping
from tandem_sim.pd.transfer import MooncakeTransfer

log = logging.getLogger("tandem_sim.decode")
PD_PATH = "/tandem/pd"
MAX_MESSAGE = 64 * 1024 * 1024  # a hand-over lists the room's destination pages


class SchedulerCrashError(RuntimeError):
    """An error SGLang raises inside the decode scheduler's loop, which kills the server (``Scheduler hit an
    exception``), e.g. the page-size check of ``CommonKVManager.try_ensure_parallel_info``."""


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
    mapping: RankMapping
    rank_urls: dict[tuple[int, int], str] = field(default_factory=dict)  # (dp rank, tp rank) -> http://ip:port
    registered: set[str] = field(default_factory=set)  # rank urls this decode rank registered with
    rooms: dict[int, asyncio.Future[None]] = field(default_factory=dict)
    heartbeat_failures: int = 0


@dataclass
class RoomWait:
    """The KV of a room is in once ``remaining`` real senders (of ``senders``) answered success."""

    done: asyncio.Future[None]
    senders: frozenset[str]  # rank urls that really send (not MLA's dummies)
    remaining: int
    first: PrefillVariant | None = None  # the prefill batch that computed the first token (from a success)


class DecodeSide:
    def __init__(
        self,
        cfg: SimConfig,
        metrics: Metrics,
        transfer: MooncakeTransfer,
        pool: PagedPool,
        rank: Rank,
        layout: KVLayout,
    ) -> None:
        self.cfg = cfg
        self.metrics = metrics
        self.transfer = transfer
        self.pool = pool  # this rank's shard of its DP group's pool
        self.rank = rank
        self.layout = layout
        transfer.register(pool.address, pool.nbytes)
        self.peers: dict[str, PrefillPeer] = {}
        self._sessions: dict[str, aiohttp.ClientSession] = {}
        self._peer_locks: dict[str, asyncio.Lock] = {}
        self._tasks: set[asyncio.Task[None]] = set()
        self._channels: dict[str, aiohttp.ClientWebSocketResponse] = {}
        self._channel_locks: dict[str, asyncio.Lock] = {}
        self._outcomes: dict[int, RoomWait] = {}  # room -> KV arrived (or the failure)
        self._settled: dict[int, dict[str, asyncio.Future[None]]] = {}  # room -> rank url -> that rank answered
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
            if int(info["page_size"]) != self.pool.page_size:
                raise SchedulerCrashError(
                    f"Page size mismatch: prefill server has page_size={info['page_size']}, but decode server has "
                    f"page_size={self.pool.page_size}. Both servers must use the same --page-size value."
                )
            mapping = rank_mapping(
                int(info["attn_tp_size"]), self.layout.attn_tp, self.rank.attn_tp_rank, self.layout.is_mla
            )
            peer = PrefillPeer(bootstrap_addr, int(info["dp_size"]), int(info["page_size"]), mapping)
            self.peers[bootstrap_addr] = peer
            return peer

    async def _rank_url(self, peer: PrefillPeer, dp_rank: int, tp_rank: int) -> str:
        url = peer.rank_urls.get((dp_rank, tp_rank))
        if url is not None:
            return url
        sess = self.session(f"http://{peer.bootstrap_addr}")
        params = {
            "prefill_dp_rank": str(dp_rank),
            "prefill_cp_rank": "0",
            "target_tp_rank": str(tp_rank),
            "target_pp_rank": "0",
        }
        async with sess.get("/route", params=params, timeout=aiohttp.ClientTimeout(total=5)) as resp:
            if resp.status != 200:
                raise ConnectionError(
                    f"Could not fetch bootstrap info for: prefill_dp_rank: {dp_rank} prefill_cp_rank: 0 "
                    f"target_tp_rank: {tp_rank} and target_pp_rank 0 (HTTP {resp.status}: {await resp.text()})"
                )
            info = await resp.json()
        url = f"http://{info['rank_ip']}:{info['rank_port']}"
        peer.rank_urls[(dp_rank, tp_rank)] = url
        if url not in peer.registered:
            body = {
                "session_id": self.transfer.session_id,
                "kv_addr": self.pool.address,
                "row_bytes": self.pool.kv_bytes,
                "page_size": self.pool.page_size,
                "tp_rank": self.rank.attn_tp_rank,
                "attn_tp_size": self.layout.attn_tp,
                "kv_heads": self.layout.total_heads,
            }
            async with self.session(url).post(f"{PD_PATH}/register", json=body) as resp:
                if resp.status != 200:
                    raise ConnectionError(f"registration with {url}: HTTP {resp.status}: {await resp.text()}")
            peer.registered.add(url)
        return url

    async def receive_kv(
        self, room: int, bootstrap_host: str, bootstrap_port: int, pages: list[int]
    ) -> PrefillVariant | None:
        """Wait until the prefill wrote this room's KV into ``pages``; raises KVTransferError. Returns the variant of
        the prefill batch that computed the first token (None if the prefill did not say)."""
        addr = f"{bootstrap_host}:{bootstrap_port}"
        self.waiting += 1
        self._gauge()
        started = time.monotonic()
        try:
            try:
                peer = await self._peer(addr)
                dp_rank = room % peer.dp_size  # the prefill follows the bootstrap room
                targets = [(t, await self._rank_url(peer, dp_rank, t)) for t in peer.mapping.target_tp_ranks]
            except KVTransferError as err:
                self.metrics.num_bootstrap_failed_reqs.inc()
                raise KVTransferError(room, err.reason) from None
            except (aiohttp.ClientError, ConnectionError, TimeoutError) as err:
                self.metrics.num_bootstrap_failed_reqs.inc()
                raise KVTransferError(room, f"Failed to bootstrap with prefill {addr}: {err}") from None
            loop = asyncio.get_running_loop()
            done: asyncio.Future[None] = loop.create_future()
            peer.rooms[room] = done
            mapping, mla = peer.mapping, self.layout.is_mla
            senders = frozenset(url for t, url in targets if not mapping.is_dummy(t, mla))
            wait = RoomWait(done, senders, mapping.required_prefill_response_num)
            self._outcomes[room] = wait
            self._settled[room] = {url: loop.create_future() for _, url in targets}
            for t, url in targets:
                hand_over = {
                    "room": room,
                    "session_id": self.transfer.session_id,
                    "dst_pages": pages,
                    "required_dst_info_num": mapping.required_dst_info_num,
                    "is_dummy": mapping.is_dummy(t, mla),
                }
                await self._hand_over(url, room, hand_over)
            try:
                await asyncio.wait_for(asyncio.shield(done), timeout=self.cfg.pd.waiting_timeout_s)
                self._settled.pop(room, None)  # the KV is in: nothing left to quiesce
                return wait.first
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

    async def _hand_over(self, url: str, room: int, body: dict[str, object]) -> None:
        try:
            ws = await self._channel(url)
            await ws.send_bytes(orjson.dumps(body))
        except (aiohttp.ClientError, ConnectionError, RuntimeError) as err:
            log.info("hand-over to prefill broke; waiting for heartbeat", extra={"room": room, "err": str(err)})
            self._settle(room, url)

    async def _read_outcomes(self, url: str, ws: aiohttp.ClientWebSocketResponse) -> None:
        """Outcomes of this rank's rooms; when the channel breaks, its rooms wait for the heartbeat or timeout."""
        try:
            async for msg in ws:
                if msg.type != aiohttp.WSMsgType.BINARY:
                    continue
                reply = orjson.loads(msg.data)
                room = int(reply["room"])
                self._settle(room, url)
                wait = self._outcomes.get(room)
                if wait is None or wait.done.done():
                    continue
                if reply.get("status") == "success":
                    if wait.first is None:
                        wait.first = PrefillVariant.from_json(reply.get("first_token_variant"))
                    if url in wait.senders:
                        wait.remaining -= 1
                        if wait.remaining <= 0:
                            wait.done.set_result(None)
                elif reply.get("status") == "expired":
                    continue  # the prefill dropped the room; the waiting timeout fails it
                else:
                    self.metrics.num_transfer_failed_reqs.inc()
                    wait.done.set_exception(KVTransferError(room, str(reply.get("reason", "unknown"))))
        finally:
            if self._channels.get(url) is ws:
                del self._channels[url]
            for room, answered in list(self._settled.items()):
                if url in answered:
                    self._settle(room, url)

    def _settle(self, room: int, url: str) -> None:
        answered = self._settled.get(room, {}).get(url)
        if answered is not None and not answered.done():
            answered.set_result(None)

    async def quiesce(self, room: int, limit_s: float = 30.0) -> None:
        """Before the room's pages are reused: wait until every prefill rank stopped writing into them (SGLang's
        deferred decode KV release, SGLANG_DISAGGREGATION_DEFERRED_DECODE_KV_RELEASE_TIMEOUT = 30 s)."""
        answered = [f for f in self._settled.pop(room, {}).values() if not f.done()]
        if answered:
            await asyncio.wait(answered, timeout=limit_s)

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
            "tp_rank": self.rank.tp_rank,
            "session_id": self.transfer.session_id,
            "prefill_peers": sorted(self.peers),
            "prefill_dp_ranks": sorted({dp for peer in self.peers.values() for dp, _ in peer.rank_urls}),
            "prefill_tp_ranks": sorted({tp for peer in self.peers.values() for _, tp in peer.rank_urls}),
            "num_decode_transfer_queue_reqs": self.waiting,
        }
