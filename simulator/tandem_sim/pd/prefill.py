"""Prefill side of PD for one GPU rank (mimics SGLang 0.5.23 ``MooncakeKVManager`` in prefill mode, over HTTP instead
of ZMQ). A prefill server has one ``PrefillSide`` per TP rank, each with its own transfer engine and staging shard.

Per request: wait until ``required_dst_info_num`` decode ranks handed over their destination pages for the room
(``SGLANG_DISAGGREGATION_BOOTSTRAP_TIMEOUT``; ``bootstrap_thread`` in ``mooncake/conn.py``), put this rank's part
of the prompt KV into a staging shard registered with Mooncake, write it into each (non-dummy) decode rank's pages
with ``batch_transfer_sync_write`` (whole rows as ``send_kvcache``; a head slice per token as
``send_kvcache_slice`` when the attention TP sizes differ), then answer the decode ranks and the client.
A failed send blacklists the decode's Mooncake session; later requests for it fail fast until it re-registers,
the probe (``send_probe``, interval doubling up to the max) succeeds, or it is dropped after the idle timeout.
"""

from __future__ import annotations

import asyncio
import logging
import random
import time
from dataclasses import dataclass, field
from typing import Any

import numpy as np
import numpy.typing as npt

from tandem_sim.config import SimConfig
from tandem_sim.engine.hicache import FileStore, L3Store, page_keys
from tandem_sim.engine.kvpool import PagedPool
from tandem_sim.metrics import Metrics
from tandem_sim.model import model
from tandem_sim.model.numerics import PrefillVariant
from tandem_sim.model.ranks import KVLayout, Rank, head_slice
from tandem_sim.pd.transfer import MooncakeTransfer

log = logging.getLogger("tandem_sim.prefill")


class TransferFailedError(RuntimeError):
    """The KV of a room could not be delivered; the message is SGLang's failure reason."""


class RoomExpiredError(RuntimeError):
    """The decode's hand-over for a room waited the bootstrap timeout without a prefill request."""


@dataclass(frozen=True)
class DecodeRegistration:
    """One decode rank's KV args (SGLang's ``KVArgsRegisterInfo``)."""

    session_id: str
    kv_addr: int
    row_bytes: int  # dst_kv_item_len per token: the bytes of each token's row this decode rank holds
    page_size: int
    tp_rank: int  # dst_tp_rank (the decode's attention-TP rank)
    attn_tp_size: int  # dst_attn_tp_size
    kv_heads: int  # the decode's model: 0 = MLA


@dataclass(frozen=True)
class HandOver:
    """One decode rank's transfer request for a room (SGLang's ``TransferInfo``)."""

    session_id: str
    pages: list[int]
    required_dst_info_num: int
    is_dummy: bool


@dataclass
class RoomState:
    """Rendezvous of the prefill request and the decode ranks' transfer requests for one bootstrap room."""

    handed_over: asyncio.Future[None]  # set once required_dst_info_num decode ranks handed over
    result: asyncio.Future[str | None]  # None = success, else the failure reason
    infos: dict[str, HandOver] = field(default_factory=dict)  # by decode session id
    created: float = field(default_factory=time.monotonic)
    # The prefill batch that computed the room's first token (SGLang computes it on the prefill and sends it along
    # with the KV): the decode decodes step 0 under its numerics.
    first: PrefillVariant | None = None


@dataclass
class FailedSessionProbe:
    last_requested: float
    next_probe_at: float
    interval: float


def _slots(pages: list[int], page_size: int, tokens: int) -> npt.NDArray[np.int64]:
    positions = np.arange(tokens, dtype=np.int64)
    return np.asarray(pages, dtype=np.int64)[positions // page_size] * page_size + positions % page_size


@dataclass(frozen=True)
class RowSlice:
    """Which bytes of each token move: ``length`` bytes at ``src_offset`` of a ``src_row``-byte source row into
    ``dst_offset`` of a ``dst_row``-byte destination row."""

    src_row: int
    dst_row: int
    src_offset: int = 0
    dst_offset: int = 0
    length: int | None = None  # None: the whole row

    @property
    def whole_rows(self) -> bool:
        return (
            self.src_row == self.dst_row
            and self.src_offset == self.dst_offset == 0
            and self.length in (None, self.src_row)
        )


def transfer_segments(
    src_base: int,
    src_pages: list[int],
    src_page_size: int,
    dst_base: int,
    dst_pages: list[int],
    dst_page_size: int,
    tokens: int,
    rows: RowSlice,
) -> tuple[list[int], list[int], list[int]]:
    """(src address, dst address, length) segments moving ``tokens`` KV rows (or a slice of each) between two
    paged pools.

    Whole rows go in contiguous runs: a run ends only where the source or the destination slots stop being
    adjacent (Mooncake's TCP transport pays per segment, about 0.2 ms each on loopback, so a 200-token prompt in
    adjacent pages is one segment). A head slice goes token by token, as ``send_kvcache_slice`` does.
    """
    if tokens <= 0:
        return [], [], []
    src_slots = _slots(src_pages, src_page_size, tokens)
    dst_slots = _slots(dst_pages, dst_page_size, tokens)
    if not rows.whole_rows:
        length = rows.src_row if rows.length is None else rows.length
        src = (src_base + src_slots * rows.src_row + rows.src_offset).tolist()
        dst = (dst_base + dst_slots * rows.dst_row + rows.dst_offset).tolist()
        return src, dst, [length] * tokens
    row = rows.src_row
    breaks = np.flatnonzero((np.diff(src_slots) != 1) | (np.diff(dst_slots) != 1)) + 1
    starts = np.concatenate(([0], breaks))
    counts = np.diff(np.concatenate((starts, [tokens])))
    src = (src_base + src_slots[starts] * row).tolist()
    dst = (dst_base + dst_slots[starts] * row).tolist()
    return src, dst, (counts * row).tolist()


class PrefillSide:
    """One prefill GPU rank: its transfer engine, its staging shard, its registered decode ranks and blacklist."""

    def __init__(
        self, cfg: SimConfig, metrics: Metrics, transfer: MooncakeTransfer, rank: Rank, layout: KVLayout
    ) -> None:
        self.cfg = cfg
        self.metrics = metrics
        self.transfer = transfer
        self.rank = rank
        self.layout = layout
        self.columns = layout.columns(rank.attn_tp_rank)  # (first byte, length) of each row this rank holds
        self.weights = model.weights(cfg.seed, cfg.kv_bytes_per_token)
        self.staging = PagedPool(cfg.max_total_tokens // cfg.page_size, cfg.page_size, self.columns[1])
        transfer.register(self.staging.address, self.staging.nbytes)
        self.decodes: dict[str, DecodeRegistration] = {}
        self.rooms: dict[int, RoomState] = {}
        self.failed_sessions: set[str] = set()
        self.probes: dict[str, FailedSessionProbe] = {}
        self._staging_free = asyncio.Condition()
        self._rng = random.Random(cfg.seed ^ 0x5EED ^ rank.tp_rank)
        self.failure_prob = cfg.transfer_failure_prob
        self.failure_sessions: frozenset[str] = frozenset()  # empty: the failure hits sends to every decode
        self.l3: L3Store | None = (
            FileStore(cfg.hicache_file_dir, cfg.kv_bytes_per_token, cfg.page_size) if cfg.hicache_file_dir else None
        )
        self.bootstrap_waiting = 0

    def _room(self, room: int) -> RoomState:
        state = self.rooms.get(room)
        if state is None:
            loop = asyncio.get_running_loop()
            state = RoomState(loop.create_future(), loop.create_future())
            self.rooms[room] = state
        return state

    # -- decode-facing ------------------------------------------------------------------------------------------
    def register_decode(self, reg: DecodeRegistration) -> None:
        """A decode rank (re-)registered its session: a re-registration clears its blacklist entry."""
        self.decodes[reg.session_id] = reg
        self._unblacklist(reg.session_id)

    async def await_transfer(self, room: int, hand_over: HandOver) -> tuple[str | None, PrefillVariant | None]:
        """A decode rank's side of the room: hand over destination pages, wait for the outcome (None = success) and
        the variant of the prefill batch that computed the first token."""
        state = self._room(room)
        state.infos[hand_over.session_id] = hand_over
        if len(state.infos) >= hand_over.required_dst_info_num and not state.handed_over.done():
            state.handed_over.set_result(None)
        try:
            reason = await asyncio.wait_for(asyncio.shield(state.result), timeout=self.cfg.pd.bootstrap_timeout_s)
            return reason, state.first
        except TimeoutError:
            # No prefill request came for the room: drop it without failing the decode, which gives up on its
            # own waiting timeout (KVPoll.WaitingForInput), as SGLang's decode does.
            if self.rooms.get(room) is state and not state.result.done():
                self.rooms.pop(room, None)
            raise RoomExpiredError(room) from None
        finally:
            if state.result.done():
                self.rooms.pop(room, None)

    # -- client-facing ------------------------------------------------------------------------------------------
    async def prefill(self, room: int, kv: npt.NDArray[np.uint8], first: PrefillVariant | None = None) -> None:
        """Send this rank's part of the prompt KV (``kv``: the whole rows) for ``room``; raises TransferFailedError.
        ``first``: the prefill batch that computed the first token, told to the decode with the success outcome."""
        state = self._room(room)
        state.first = first
        try:
            await self._prefill(room, kv, state)
        except TransferFailedError as err:
            if not state.result.done():
                state.result.set_result(str(err))
            raise
        except BaseException:
            if not state.result.done():
                state.result.set_result("Prefill request aborted")
            raise
        else:
            if not state.result.done():
                state.result.set_result(None)
        finally:
            if not state.handed_over.done() or state.result.done():
                self.rooms.pop(room, None)

    async def _prefill(self, room: int, kv: npt.NDArray[np.uint8], state: RoomState) -> None:
        self.bootstrap_waiting += 1
        self.metrics.num_prefill_bootstrap_queue_reqs.set(self.bootstrap_waiting)
        started = time.monotonic()
        try:
            await asyncio.wait_for(asyncio.shield(state.handed_over), timeout=self.cfg.pd.bootstrap_timeout_s)
        except TimeoutError:
            self.metrics.num_bootstrap_failed_reqs.inc()
            elapsed = time.monotonic() - started
            raise TransferFailedError(
                f"Request {room} timed out after {elapsed:.1f}s in KVPoll.Bootstrapping"
            ) from None
        finally:
            self.bootstrap_waiting -= 1
            self.metrics.num_prefill_bootstrap_queue_reqs.set(self.bootstrap_waiting)
        targets = [h for h in state.infos.values() if not h.is_dummy]
        for hand_over in targets:
            if hand_over.session_id in self.failed_sessions:
                probe = self.probes.get(hand_over.session_id)
                if probe is not None:
                    probe.last_requested = time.monotonic()
                self._transfer_failed()
                raise TransferFailedError(
                    f"Decode instance could be dead, remote mooncake session {hand_over.session_id} is not alive"
                )
            if hand_over.session_id not in self.decodes:
                self._transfer_failed()
                raise TransferFailedError(f"Decode session {hand_over.session_id} is not registered with this prefill")
        if not targets:
            return  # MLA: a dummy rank for every decode rank of this room sends nothing
        n = len(kv)
        pages = await self._alloc_staging(n)
        try:
            first, length = self.columns
            self.staging.write(pages, 0, np.ascontiguousarray(kv[:, first : first + length]))
            for hand_over in targets:
                await self._send(room, self.decodes[hand_over.session_id], pages, hand_over.pages, n)
        finally:
            self.staging.free(pages)
            async with self._staging_free:
                self._staging_free.notify_all()

    def prompt_kv(self, prompt: model.Tokens) -> npt.NDArray[np.uint8]:
        """The prompt's KV rows: the longest prefix of pages found in the L3 store is read back (a prefix hit), the
        rest computed and written through to the store."""
        kv = model.compute_kv(self.weights, prompt, 0)
        if self.l3 is None:
            return kv
        ps = self.cfg.page_size
        keys = page_keys(prompt, ps, self.cfg.seed)
        cached = self.l3.longest_prefix(keys)
        if cached:
            kv[: len(cached) * ps] = np.concatenate(cached)
            self.metrics.hicache_hit_tokens.inc(len(cached) * ps)
        for j in range(len(cached), len(keys)):
            self.l3.put(keys[j], kv[j * ps : (j + 1) * ps])
        return kv

    async def _alloc_staging(self, tokens: int) -> list[int]:
        async with self._staging_free:
            while (pages := self.staging.alloc(tokens)) is None:
                await self._staging_free.wait()
        return pages

    def _row_slice(self, reg: DecodeRegistration) -> RowSlice | str:
        """What this rank writes into each of ``reg``'s token rows, or why it cannot (SGLang's checks)."""
        layout, src_row = self.layout, self.columns[1]
        if reg.kv_heads != layout.total_heads:
            return "Decode KV layout does not match this prefill (MLA vs. KV heads)"
        if layout.is_mla or reg.attn_tp_size == layout.attn_tp:  # send_kvcache: whole rows
            if reg.row_bytes != src_row:
                return "Decode KV layout does not match this prefill (KV bytes per token)"
            return RowSlice(src_row, reg.row_bytes)
        heads = head_slice(layout.attn_tp, reg.attn_tp_size, self.rank.tp_rank, reg.tp_rank, layout.total_heads)
        length = heads.num_heads * layout.head_bytes
        if length > reg.row_bytes:
            return f"slice size ({length}) exceeds target token slot size ({reg.row_bytes})"
        return RowSlice(
            src_row,
            reg.row_bytes,
            heads.src_head_start * layout.head_bytes,
            heads.dst_head_start * layout.head_bytes,
            length,
        )

    async def _send(
        self, room: int, reg: DecodeRegistration, src_pages: list[int], dst_pages: list[int], n: int
    ) -> None:
        rows = self._row_slice(reg)
        if isinstance(rows, str) or len(dst_pages) * reg.page_size < n:
            self._transfer_failed()
            raise TransferFailedError(rows if isinstance(rows, str) else "Decode KV pages do not hold the prompt")
        src, dst, lengths = transfer_segments(
            self.staging.address, src_pages, self.cfg.page_size, reg.kv_addr, dst_pages, reg.page_size, n, rows
        )
        started = time.monotonic()
        targeted = not self.failure_sessions or reg.session_id in self.failure_sessions
        if self.failure_prob > 0 and targeted and self._rng.random() < self.failure_prob:
            rc = -1  # SGLANG_TEST_DISAGG_FAILURE_PROB: a send that fails like a dead peer
        else:
            rc = await self.transfer.write(reg.session_id, src, dst, lengths)
        if rc != 0:
            self._blacklist(reg.session_id)
            self._transfer_failed()
            raise TransferFailedError(f"Failed to send kv chunk of {room} to {reg.session_id} (rc={rc})")
        elapsed = max(time.monotonic() - started, 1e-9)
        total = sum(lengths)
        self.metrics.kv_transfer_total_mb.observe(total / 1e6)
        self.metrics.kv_transfer_latency_ms.observe(elapsed * 1000)
        self.metrics.kv_transfer_speed_gb_s.observe(total / elapsed / 1e9)

    def _transfer_failed(self) -> None:
        self.metrics.num_transfer_failed_reqs.inc()

    # -- blacklist and probe ------------------------------------------------------------------------------------
    def _blacklist(self, session_id: str) -> None:
        if session_id not in self.failed_sessions:
            log.warning("blacklisting decode session after a failed send", extra={"session": session_id})
        self.failed_sessions.add(session_id)

    def _unblacklist(self, session_id: str) -> None:
        self.failed_sessions.discard(session_id)
        self.probes.pop(session_id, None)

    async def probe_loop(self) -> None:
        """SGLang's failed-session probe: per-session exponential backoff, idle sessions dropped."""
        pd = self.cfg.pd
        if not pd.enable_failed_session_probe:
            return
        while True:
            await asyncio.sleep(pd.probe_interval_s)
            await self.probe_pass()

    async def probe_pass(self) -> None:
        pd = self.cfg.pd
        now = time.monotonic()
        for session_id in list(self.probes):
            if session_id not in self.failed_sessions:
                del self.probes[session_id]
        due = []
        for session_id in list(self.failed_sessions):
            probe = self.probes.setdefault(session_id, FailedSessionProbe(now, now, pd.probe_interval_s))
            if now - probe.last_requested >= pd.failed_session_idle_timeout_s:
                self._unblacklist(session_id)
                log.info("dropped idle blacklisted session", extra={"session": session_id})
            elif now >= probe.next_probe_at:
                due.append(session_id)
        for session_id in due:
            rc = await self.transfer.probe(session_id)
            if rc == 0 and session_id in self.failed_sessions:
                self._unblacklist(session_id)
                self.metrics.failed_session_recoveries.inc()
                log.info("session recovered via probe; un-blacklisted", extra={"session": session_id})
            elif rc != 0 and (failing := self.probes.get(session_id)) is not None:
                failing.interval = min(2 * failing.interval, pd.probe_max_interval_s)
                failing.next_probe_at = time.monotonic() + failing.interval

    def internal_state(self) -> dict[str, Any]:
        return {
            "tp_rank": self.rank.tp_rank,
            "session_id": self.transfer.session_id,
            "registered_decode_sessions": sorted(self.decodes),
            "failed_sessions": sorted(self.failed_sessions),
            "num_prefill_bootstrap_queue_reqs": self.bootstrap_waiting,
            "transfer_failure_prob": self.failure_prob,
            "transfer_failure_sessions": sorted(self.failure_sessions),
        }
