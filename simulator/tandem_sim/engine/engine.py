"""The decoding engine shared by aggregated and decode mode: admission, KV pages, decode loop, KV offload.

Offload (``--disaggregation-decode-enable-offload-kvcache``) copies every completed page of newly decoded KV
from the device pool to the host pool asynchronously, like SGLang's ``DecodeKVCacheOffloadManager``. The
fixed protocol (SGLang upstream, 2026) is implemented: a request's pages are freed only when it has finished
**and** its in-flight copies (a counter on the request object itself) have drained.
``--sim-inject-offload-race`` re-creates both upstream races instead:

1. on a request's first offload its prompt pages go back to the allocator while the request still attends to
   them; concurrent admissions reuse them, so the request reads another request's prompt KV;
2. on finish its pages are freed at once while device->host copies are still reading them, so the host copy
   is poisoned (counted in ``tandem_sim:offload_poisoned_pages_total``).
"""

from __future__ import annotations

import asyncio
import time
from collections import deque
from collections.abc import Awaitable, Callable
from dataclasses import dataclass, field

import numpy as np

from tandem_sim.config import SimConfig
from tandem_sim.engine import hicache
from tandem_sim.engine.hicache import FileStore
from tandem_sim.engine.kvpool import PagedPool, ShardedPool
from tandem_sim.engine.radix import RadixCache
from tandem_sim.engine.stepper import Stepper
from tandem_sim.metrics import Metrics
from tandem_sim.model import model
from tandem_sim.model.numerics import PrefillVariant, StepLogprobs, Variant
from tandem_sim.model.ranks import KVLayout

# Simulated device->host(+storage backend) copy time per page: not instantaneous, which is the races' window.
OFFLOAD_COPY_S = 0.05


@dataclass(eq=False)  # identity semantics: offload state is keyed by the request object, never by its id
class RunningRequest:
    rid: str
    prompt: model.Tokens
    params: model.SamplingParams
    pages: list[int] = field(default_factory=list)
    output_ids: list[int] = field(default_factory=list)
    output_words: list[str] = field(default_factory=list)
    inflight_offloads: int = 0
    next_offload_pos: int = -1  # first position of the next page to copy device->host (-1: not started)
    l3_chain: tuple[int, bytes] | None = None  # (end position, key) of the last page put in the L3 store
    prompt_pages_released: int = 0  # race 1: how many leading pages were handed back early
    top_logprobs: int | None = None  # logprobs asked for (the top k too); None: not asked for
    output_logprobs: list[StepLogprobs] = field(default_factory=list)  # one per output token, when asked for
    finished: bool = False
    released: bool = False

    @property
    def prompt_len(self) -> int:
        return len(self.prompt.ids)


def _tokens_at(req: RunningRequest, start: int, end: int) -> model.Tokens:
    """The request's tokens (prompt, then decoded) at positions ``start..end``."""
    n = req.prompt_len
    a, b = max(start - n, 0), max(end - n, 0)
    ids = req.prompt.ids[start : min(end, n)] + req.output_ids[a:b]
    return model.Tokens(ids, req.prompt.words[start : min(end, n)] + req.output_words[a:b])


class Engine:
    def __init__(self, cfg: SimConfig, metrics: Metrics, layout: KVLayout) -> None:
        self.cfg = cfg
        self.metrics = metrics
        self.weights = model.weights(cfg.seed, cfg.kv_bytes_per_token)
        # The KV of this attention-DP group, sharded over its attention-TP ranks.
        self.pool = ShardedPool(cfg.max_total_tokens // cfg.page_size, cfg.page_size, layout)
        self.group: list[Engine] = [self]  # every DP group's engine of this server: the gauges sum over them
        host_pages = max(1, cfg.host_pool_tokens // cfg.page_size)
        self.host = PagedPool(host_pages, cfg.page_size, cfg.kv_bytes_per_token)
        self._host_cursor = 0
        self.l3 = (
            FileStore(cfg.hicache_file_dir, cfg.kv_bytes_per_token, cfg.page_size) if cfg.hicache_file_dir else None
        )
        self._pages_changed = asyncio.Condition()
        self._running = 0
        self._queued = 0
        self.offloaded_pages = 0
        self._frees: set[asyncio.Task[None]] = set()
        self.poisoned_pages = 0
        self._token_seconds: deque[list[int]] = deque(maxlen=11)
        # One scheduler per attention-DP group: its batch loop and (prefill/aggregated) its radix prefix cache.
        self.numerics = cfg.numerics()
        # --sim-inject-offload-race, switchable at runtime (``/tandem/sim/faults``): a decode that garbles, then stops
        self.offload_race = cfg.inject_offload_race
        self.stepper = Stepper(cfg.profile, cfg.max_prefill_tokens, cfg.chunked_prefill_size, numerics=self.numerics)
        self.radix = RadixCache(cfg.page_size) if cfg.radix_cache and cfg.mode != "decode" else None
        self._prefilling = 0  # prompts waiting for or in prefill batches (SGLang's waiting queue)
        self._admitted_prefilling = 0  # of those, the ones holding pool pages (counted in _running)

    @property
    def running(self) -> int:
        """Requests holding device KV (SGLang's ``num_running_reqs``)."""
        return self._running

    # -- admission -------------------------------------------------------------------------------------------
    async def admit(self, req: RunningRequest) -> None:
        """Reserve pages for the prompt and every token it may generate; waits while every running slot is taken
        (``--max-running-requests``) or the pool is full. Pages are taken only with a slot (SGLang's decode
        pre-allocates only for the requests the running batch has room for: ``DecodePreallocQueue.pop_preallocated``
        in ``python/sglang/srt/disaggregation/decode.py``): taking them first and waiting for a slot leaked them, and
        a full decode's pool filled up with pages nobody held (seen: 99.8 % KV usage, nothing running)."""
        tokens = req.prompt_len + req.params.max_new_tokens
        self._queued += 1
        self._gauges()
        try:
            async with self._pages_changed:
                while True:
                    if self._running < self.cfg.max_running_requests:
                        pages = self.pool.alloc(tokens)
                        if pages is not None:
                            break
                    await self._pages_changed.wait()
        finally:
            self._queued -= 1
        req.pages = pages
        self._running += 1
        self._gauges()

    async def release(self, req: RunningRequest) -> None:
        """The request is over (finished, failed or aborted): free its pages per the offload protocol."""
        if req.finished:
            return
        req.finished = True
        self._running -= 1
        if self.radix is not None:  # cache_finished_req: prompt + output stay in the tree for the next turn
            tokens = _tokens_at(req, 0, req.prompt_len + len(req.output_ids))
            self.radix.insert(tokens.ids, tokens.words, self._cache_capacity())
        if self.cfg.offload and not req.released:
            self._offload_tail(req)
        if req.inflight_offloads == 0 or self.offload_race:
            await self._free(req)
        self._gauges()

    async def _free(self, req: RunningRequest) -> None:
        if req.released:
            return
        req.released = True
        self.pool.free(req.pages[req.prompt_pages_released :])
        async with self._pages_changed:
            self._pages_changed.notify_all()
        self._gauges()

    # -- prefill -----------------------------------------------------------------------------------------------
    async def prefill(self, prompt: model.Tokens, admitted: bool = True) -> PrefillVariant:
        """Run the prompt through prefill batches; returns the variant of the batch that finished it (what computed
        the first token), which holds its cached tokens (skipped compute). ``admitted``: the request holds pool pages
        (aggregated mode), so it counts as running once its prefill is done."""
        cached = self.radix.match_prefix(prompt.ids, prompt.words) if self.radix is not None else 0
        self._prefilling += 1
        self._admitted_prefilling += admitted
        self._gauges()
        try:
            variant = await self.stepper.prefill(len(prompt.ids) - cached, cached)
        finally:
            self._prefilling -= 1
            self._admitted_prefilling -= admitted
            self._gauges()
        if self.radix is not None:  # cache_unfinished_req: the prompt's pages go into the tree
            self.radix.insert(prompt.ids, prompt.words, self._cache_capacity())
        m = self.metrics
        m.prompt_tokens.inc(len(prompt.ids))
        m.cache_hit_rate.set(cached / max(1, len(prompt.ids)))
        if cached:
            m.cached_tokens.inc(cached)
        return variant

    def _cache_capacity(self) -> int:
        """Tokens the tree may hold: what running requests leave of ``--max-total-tokens``."""
        return self.pool.capacity_tokens - self.pool.used_tokens

    # -- KV ----------------------------------------------------------------------------------------------------
    def write_prompt_kv_locally(self, req: RunningRequest) -> None:
        self.pool.write(req.pages, 0, model.compute_kv(self.weights, req.prompt, 0))

    def _read_rows(self, req: RunningRequest) -> Callable[[int, int], np.ndarray]:
        def read(start: int, count: int) -> np.ndarray:
            return self.pool.read(req.pages, start, count)

        return read

    # -- decoding ----------------------------------------------------------------------------------------------
    async def decode(
        self,
        req: RunningRequest,
        on_token: Callable[[int, str], Awaitable[bool]] | None = None,
        first: Variant | None = None,
    ) -> str:
        """Generate until EOS/stop/length. Returns the finish reason type ("stop" or "length").

        ``first``: the variant of the prefill batch that computed the first token (a PD decode gets it from the
        prefill's outcome; None: unperturbed). ``on_token(token, word)`` is awaited after each token (its logprobs,
        when asked for, are then ``req.output_logprobs[-1]``); returning False stops generation (a stop string
        matched).
        """
        self.stepper.join()
        try:
            return await self._decode_loop(req, on_token, first)
        finally:
            self.stepper.leave()

    async def _decode_loop(
        self, req: RunningRequest, on_token: Callable[[int, str], Awaitable[bool]] | None, first: Variant | None
    ) -> str:
        decoder = model.Decoder(
            self.weights, req.prompt_len, req.params, self._read_rows(req), self.numerics, req.top_logprobs
        )
        last = time.monotonic()
        variant = first
        for step in range(req.params.max_new_tokens):
            position = req.prompt_len + len(req.output_ids)
            if step:  # the first token comes out of the prefill; every later one takes a decode step of the batch
                variant = await self.stepper.decode_step(position)
                now = time.monotonic()
                self.metrics.inter_token_latency.observe(now - last)
                last = now
            token, word = decoder.next_token(variant)
            if token == model.EOS_ID:
                return "stop"
            assert decoder.last_row is not None
            self.pool.write(req.pages, position, decoder.last_row)
            if decoder.logprobs is not None:
                req.output_logprobs.append(decoder.logprobs)
            req.output_ids.append(token)
            req.output_words.append(word)
            self._maybe_offload(req)
            self.metrics.generation_tokens.inc()
            self._note_token()
            if on_token is not None and not await on_token(token, word):
                return "stop"
        return "length"

    def _note_token(self) -> None:
        second = int(time.monotonic())
        if self._token_seconds and self._token_seconds[-1][0] == second:
            self._token_seconds[-1][1] += 1
        else:
            self._token_seconds.append([second, 1])  # bounded: one entry per second of the last 10

    def gen_throughput(self) -> float:
        """Tokens per second over the last 10 s (SGLang's ``gen_throughput`` gauge)."""
        now = int(time.monotonic())
        return sum(count for second, count in self._token_seconds if second > now - 10) / 10.0

    # -- offload -----------------------------------------------------------------------------------------------
    def _maybe_offload(self, req: RunningRequest) -> None:
        """Copy each page device->host once all its slots are written (pages are aligned on positions, so the
        first one may end with prompt tokens)."""
        if not self.cfg.offload:
            return
        ps = self.cfg.page_size
        if req.next_offload_pos < 0:
            req.next_offload_pos = req.prompt_len - req.prompt_len % ps
        start = req.next_offload_pos
        if req.prompt_len + len(req.output_ids) < start + ps:
            return
        req.next_offload_pos += ps
        if self.offload_race and req.prompt_pages_released == 0:
            # Race 1 (upstream bug): prompt slots handed back on the first offload, still attended to.
            full_prompt_pages = req.prompt_len // ps
            if full_prompt_pages:
                self.pool.free(req.pages[:full_prompt_pages])
                req.prompt_pages_released = full_prompt_pages
        self._copy(req, start, ps)

    def _offload_tail(self, req: RunningRequest) -> None:
        """At finish, the written slots not yet copied (a partial page) are copied too."""
        if req.next_offload_pos < 0:
            req.next_offload_pos = req.prompt_len - req.prompt_len % self.cfg.page_size
        tail = req.prompt_len + len(req.output_ids) - req.next_offload_pos
        if tail > 0:
            start = req.next_offload_pos
            req.next_offload_pos += tail
            self._copy(req, start, tail)

    def _copy(self, req: RunningRequest, start: int, count: int) -> None:
        req.inflight_offloads += 1
        expected = model.compute_kv(self.weights, _tokens_at(req, start, start + count), start)
        asyncio.get_running_loop().call_later(OFFLOAD_COPY_S, self._finish_copy, req, start, expected)

    def _finish_copy(self, req: RunningRequest, start: int, expected: np.ndarray) -> None:
        """The device->host copy lands: it reads the device slots *now*. Full pages also go to the L3 store."""
        copied = self.pool.read(req.pages, start, len(expected))
        host_page = self._host_cursor % self.host.num_pages
        self._host_cursor += 1
        self.host.write([host_page], 0, copied[: self.cfg.page_size])
        self.offloaded_pages += 1
        if not np.array_equal(copied, expected):
            self.poisoned_pages += 1
            self.metrics.offload_poisoned_pages.inc()
        if self.l3 is not None and len(copied) == self.cfg.page_size and start % self.cfg.page_size == 0:
            self.l3.put(self._l3_key(req, start), copied)
        req.inflight_offloads -= 1
        if req.finished and req.inflight_offloads == 0 and not req.released:
            task = asyncio.get_running_loop().create_task(self._free(req))
            self._frees.add(task)
            task.add_done_callback(self._frees.discard)

    def _l3_key(self, req: RunningRequest, start: int) -> str:
        """Key of the page at ``start``: the prefix chain is extended page by page, computed once from scratch."""
        ps = self.cfg.page_size
        if req.l3_chain is not None and req.l3_chain[0] == start:
            chain = req.l3_chain[1]
        else:
            chain = hicache.chain_start(ps, self.cfg.seed)
            for page in range(0, start, ps):
                before = _tokens_at(req, page, page + ps)
                chain = hicache.chain_extend(chain, before.ids, before.words)
        page_tokens = _tokens_at(req, start, start + ps)
        chain = hicache.chain_extend(chain, page_tokens.ids, page_tokens.words)
        req.l3_chain = (start + ps, chain)
        return chain.hex()

    # -- state -------------------------------------------------------------------------------------------------
    def _gauges(self) -> None:
        m, group = self.metrics, self.group
        used = sum(e.pool.used_tokens for e in group)
        # SGLang: running = the decoding batch; queue = waiting to be admitted or prefilled (its waiting_queue).
        m.num_running_reqs.set(sum(e._running - e._admitted_prefilling for e in group))
        m.num_queue_reqs.set(sum(e._queued + e._prefilling for e in group))
        m.kv_used_tokens.set(used)
        m.kv_available_tokens.set(sum(e.pool.free_pages * e.pool.page_size for e in group))
        m.token_usage.set(used / max(1, sum(e.pool.capacity_tokens for e in group)))

    def internal_state(self) -> dict[str, object]:
        return {
            "num_running_reqs": self._running,
            "num_queue_reqs": self._queued,
            "num_prefilling_reqs": self._prefilling,
            "radix_cached_tokens": self.radix.cached_tokens if self.radix is not None else 0,
            "prefill_batches": self.stepper.stats.prefill_batches,
            "prefill_chunks": self.stepper.stats.prefill_chunks,
            "decode_steps": self.stepper.stats.decode_steps,
            "max_decode_batch": self.stepper.stats.max_decode_batch,
            "kv_used_tokens": self.pool.used_tokens,
            "max_total_num_tokens": self.pool.capacity_tokens,
            "offloaded_pages": self.offloaded_pages,
            "offload_poisoned_pages": self.poisoned_pages,
        }
