"""Prefill side of PD (mimics SGLang 0.5.23 ``MooncakeKVManager`` in prefill mode, over HTTP instead of ZMQ).

Per request: wait for the decode's destination pages for the room (``SGLANG_DISAGGREGATION_BOOTSTRAP_TIMEOUT``),
compute the prompt KV into a staging pool registered with Mooncake, write it into the decode's pages with
``batch_transfer_sync_write``, then answer the decode (success or the failure reason) and the client.
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

from tandem_sim import model
from tandem_sim.config import SimConfig
from tandem_sim.hicache import FileStore, page_keys
from tandem_sim.kvpool import PagedPool
from tandem_sim.metrics import Metrics
from tandem_sim.transfer import MooncakeTransfer

log = logging.getLogger("tandem_sim.prefill")


class TransferFailedError(RuntimeError):
    """The KV of a room could not be delivered; the message is SGLang's failure reason."""


class RoomExpiredError(RuntimeError):
    """The decode's hand-over for a room waited the bootstrap timeout without a prefill request."""


@dataclass
class DecodeRegistration:
    session_id: str
    kv_addr: int
    kv_bytes_per_token: int
    page_size: int


@dataclass
class RoomState:
    """Rendezvous of the prefill request and the decode's transfer request for one bootstrap room."""

    dst: asyncio.Future[tuple[str, list[int]]]  # (decode session id, destination pages)
    result: asyncio.Future[str | None]  # None = success, else the failure reason
    created: float = field(default_factory=time.monotonic)


@dataclass
class FailedSessionProbe:
    last_requested: float
    next_probe_at: float
    interval: float


def _slots(pages: list[int], page_size: int, tokens: int) -> npt.NDArray[np.int64]:
    positions = np.arange(tokens, dtype=np.int64)
    return np.asarray(pages, dtype=np.int64)[positions // page_size] * page_size + positions % page_size


def transfer_segments(
    src_base: int,
    src_pages: list[int],
    src_page_size: int,
    dst_base: int,
    dst_pages: list[int],
    dst_page_size: int,
    tokens: int,
    row: int,
) -> tuple[list[int], list[int], list[int]]:
    """Contiguous (src address, dst address, length) runs moving ``tokens`` KV rows between two paged pools.

    A run ends only where the source or the destination slots stop being adjacent: Mooncake's TCP transport
    pays per segment (about 0.2 ms each on loopback), so a 200-token prompt in adjacent pages is one segment.
    """
    if tokens <= 0:
        return [], [], []
    src_slots = _slots(src_pages, src_page_size, tokens)
    dst_slots = _slots(dst_pages, dst_page_size, tokens)
    breaks = np.flatnonzero((np.diff(src_slots) != 1) | (np.diff(dst_slots) != 1)) + 1
    starts = np.concatenate(([0], breaks))
    counts = np.diff(np.concatenate((starts, [tokens])))
    src = (src_base + src_slots[starts] * row).tolist()
    dst = (dst_base + dst_slots[starts] * row).tolist()
    return src, dst, (counts * row).tolist()


class PrefillSide:
    def __init__(self, cfg: SimConfig, metrics: Metrics, transfer: MooncakeTransfer) -> None:
        self.cfg = cfg
        self.metrics = metrics
        self.transfer = transfer
        self.weights = model.weights(cfg.seed, cfg.kv_bytes_per_token)
        self.staging = PagedPool(cfg.max_total_tokens // cfg.page_size, cfg.page_size, cfg.kv_bytes_per_token)
        transfer.register(self.staging.address, self.staging.nbytes)
        self.decodes: dict[str, DecodeRegistration] = {}
        self.rooms: dict[int, RoomState] = {}
        self.failed_sessions: set[str] = set()
        self.probes: dict[str, FailedSessionProbe] = {}
        self._staging_free = asyncio.Condition()
        self._rng = random.Random(cfg.seed ^ 0x5EED)
        self.failure_prob = cfg.transfer_failure_prob
        self.l3 = (
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
        """A decode (re-)registered its session: a re-registration clears its blacklist entry."""
        self.decodes[reg.session_id] = reg
        self._unblacklist(reg.session_id)

    async def await_transfer(self, room: int, session_id: str, dst_pages: list[int]) -> str | None:
        """Decode's side of the room: hand over destination pages, wait for the outcome (None = success)."""
        state = self._room(room)
        if not state.dst.done():
            state.dst.set_result((session_id, dst_pages))
        try:
            return await asyncio.wait_for(asyncio.shield(state.result), timeout=self.cfg.pd.bootstrap_timeout_s)
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
    async def prefill(self, room: int, prompt: model.Tokens) -> None:
        """Compute and send the KV of ``prompt`` for ``room``; raises TransferFailedError on failure."""
        state = self._room(room)
        try:
            await self._prefill(room, prompt, state)
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
            if not state.dst.done() or state.result.done():
                self.rooms.pop(room, None)

    async def _prefill(self, room: int, prompt: model.Tokens, state: RoomState) -> None:
        self.bootstrap_waiting += 1
        self.metrics.num_prefill_bootstrap_queue_reqs.set(self.bootstrap_waiting)
        started = time.monotonic()
        try:
            session_id, dst_pages = await asyncio.wait_for(
                asyncio.shield(state.dst), timeout=self.cfg.pd.bootstrap_timeout_s
            )
        except TimeoutError:
            self.metrics.num_bootstrap_failed_reqs.inc()
            elapsed = time.monotonic() - started
            raise TransferFailedError(
                f"Request {room} timed out after {elapsed:.1f}s in KVPoll.Bootstrapping"
            ) from None
        finally:
            self.bootstrap_waiting -= 1
            self.metrics.num_prefill_bootstrap_queue_reqs.set(self.bootstrap_waiting)
        if session_id in self.failed_sessions:
            probe = self.probes.get(session_id)
            if probe is not None:
                probe.last_requested = time.monotonic()
            self._transfer_failed()
            raise TransferFailedError(
                f"Decode instance could be dead, remote mooncake session {session_id} is not alive"
            )
        reg = self.decodes.get(session_id)
        if reg is None:
            self._transfer_failed()
            raise TransferFailedError(f"Decode session {session_id} is not registered with this prefill")
        n = len(prompt.ids)
        pages = await self._alloc_staging(n)
        try:
            await asyncio.sleep(self.cfg.prefill_ms_per_token * n / 1000.0)
            self.staging.write(pages, 0, self._prompt_kv(prompt))
            self.metrics.prompt_tokens.inc(n)
            await self._send(room, reg, pages, dst_pages, n)
        finally:
            self.staging.free(pages)
            async with self._staging_free:
                self._staging_free.notify_all()

    def _prompt_kv(self, prompt: model.Tokens) -> npt.NDArray[np.uint8]:
        """The prompt's KV: the longest prefix of pages found in the L3 store is read back (a prefix hit), the rest
        computed and written through to the store."""
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

    async def _send(
        self, room: int, reg: DecodeRegistration, src_pages: list[int], dst_pages: list[int], n: int
    ) -> None:
        row = self.cfg.kv_bytes_per_token
        if len(dst_pages) * reg.page_size < n or reg.kv_bytes_per_token != row:
            self._transfer_failed()
            raise TransferFailedError("Decode KV layout does not match this prefill (KV bytes per token or pages)")
        src, dst, lengths = transfer_segments(
            self.staging.address, src_pages, self.cfg.page_size, reg.kv_addr, dst_pages, reg.page_size, n, row
        )
        started = time.monotonic()
        if self.failure_prob > 0 and self._rng.random() < self.failure_prob:
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
            "registered_decode_sessions": sorted(self.decodes),
            "failed_sessions": sorted(self.failed_sessions),
            "num_prefill_bootstrap_queue_reqs": self.bootstrap_waiting,
            "transfer_failure_prob": self.failure_prob,
        }
