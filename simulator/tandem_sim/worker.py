"""One simulated SGLang server node: runs a parsed request in aggregated, prefill or decode mode over its GPU ranks.

``Worker.run`` is the whole life of a request (admission, prompt KV, decode loop, release); the HTTP layer
(``http/server.py``) only parses bodies and formats responses.

SGLang's process model (``model/ranks.py``): the node runs ``tp_size / nnodes`` ranks. Ranks are grouped into
attention-DP groups; each group has one KV pool sharded over its attention-TP ranks (one ``Engine``) and, in PD
mode, every rank has its own Mooncake engine (own session id) and its own ``PrefillSide``/``DecodeSide``. A prefill
request runs on DP group ``room % attn_dp_size`` (``follow_bootstrap_room``, SGLang's prefill default), a decode or
aggregated request on the next group in turn (``round_robin``, the default otherwise), and on every rank of the
group at once: the first rank that fails fails the request, as the scheduler's all-reduced poll does.
"""

from __future__ import annotations

import asyncio
import itertools
import logging
import time
from collections.abc import Awaitable, Callable, Coroutine
from typing import Any, TypeVar

import numpy as np

from tandem_sim.api.requests import GenerateInput
from tandem_sim.api.responses import Outcome
from tandem_sim.config import SimConfig
from tandem_sim.engine.engine import Engine, RunningRequest
from tandem_sim.engine.kvpool import OutOfPagesError
from tandem_sim.metrics import Metrics
from tandem_sim.model import model
from tandem_sim.model.numerics import PrefillVariant
from tandem_sim.model.ranks import Topology
from tandem_sim.pd.decode import DecodeSide, KVTransferError, SchedulerCrashError
from tandem_sim.pd.mooncake_store import MooncakeL3, open_store
from tandem_sim.pd.multinode import Rendezvous
from tandem_sim.pd.prefill import PrefillSide, TransferFailedError
from tandem_sim.pd.transfer import MooncakeTransfer


class GenerationError(RuntimeError):
    """The request failed; ``status`` is the HTTP status SGLang answers with."""

    def __init__(self, message: str, status: int) -> None:
        super().__init__(message)
        self.status = status


OnProgress = Callable[[Outcome], Awaitable[None]]


T = TypeVar("T")
log = logging.getLogger("tandem_sim.worker")


def remote_nodes(topology: Topology, dp_rank: int) -> list[int]:
    """The other nodes that run ranks of attention-DP group ``dp_rank``."""
    attn_tp = topology.attn_tp_size
    nodes = {tp // topology.ranks_per_node for tp in range(dp_rank * attn_tp, (dp_rank + 1) * attn_tp)}
    return sorted(nodes - {topology.node_rank})


class RankStartError(RuntimeError):
    """A rank could not start (SGLang: its scheduler process dies during initialization)."""

    def __init__(self, tp_rank: int, cause: Exception) -> None:
        super().__init__(f"Rank {tp_rank} scheduler died during initialization: {type(cause).__name__}: {cause}")
        self.tp_rank = tp_rank
        self.cause = cause


async def run_together(jobs: list[Coroutine[Any, Any, T]]) -> list[T]:
    """Run the jobs (one per rank, or per batch item) concurrently; the first failure cancels the others and is
    raised."""
    if len(jobs) == 1:
        return [await jobs[0]]
    tasks = [asyncio.ensure_future(job) for job in jobs]
    try:
        return list(await asyncio.gather(*tasks))
    finally:
        for task in tasks:
            task.cancel()


class Worker:
    def __init__(self, cfg: SimConfig, metrics: Metrics, rank_host: str, group: Rendezvous | None = None) -> None:
        self.cfg = cfg
        self.metrics = metrics
        self.group = group
        topology = cfg.topology
        self.ranks = topology.local_ranks()
        layout = cfg.kv_layout
        # Node 0 runs every DP group's scheduling (and keeps a copy of remote ranks' KV shards to decode from).
        leader = cfg.node_rank == 0
        dp_ranks = list(range(cfg.attn_dp_size)) if leader else sorted({r.attn_dp_rank for r in self.ranks})
        self._remote_nodes = {dp: remote_nodes(topology, dp) for dp in dp_ranks}
        self.engines = {dp: Engine(cfg, metrics, layout) for dp in dp_ranks}
        for engine in self.engines.values():
            engine.group = list(self.engines.values())
        self.engine = self.engines[dp_ranks[0]]
        self._turn = itertools.cycle(dp_ranks)
        self.transfers: list[MooncakeTransfer] = []
        self.prefill_ranks: list[PrefillSide] = []
        self.decode_ranks: list[DecodeSide] = []
        self._prefill_by_dp: dict[int, list[PrefillSide]] = {dp: [] for dp in dp_ranks}
        self._decode_by_dp: dict[int, list[DecodeSide]] = {dp: [] for dp in dp_ranks}  # ranks of this node
        if cfg.mode != "null":
            for rank in self.ranks:
                try:
                    transfer = MooncakeTransfer(rank_host)  # one engine per GPU rank
                except Exception as err:
                    self.close_transfers()
                    raise RankStartError(rank.tp_rank, err) from err
                self.transfers.append(transfer)
                if cfg.mode == "prefill":
                    side = PrefillSide(cfg, metrics, transfer, rank, layout)
                    self.prefill_ranks.append(side)
                    self._prefill_by_dp[rank.attn_dp_rank].append(side)
                else:
                    shard = self.engines[rank.attn_dp_rank].pool.shards[rank.attn_tp_rank]
                    decode = DecodeSide(cfg, metrics, transfer, shard, rank, layout)
                    self.decode_ranks.append(decode)
                    self._decode_by_dp[rank.attn_dp_rank].append(decode)
        self._open_stores()
        self.tasks: dict[str, asyncio.Task[Any]] = {}
        self._background: set[asyncio.Task[None]] = set()
        self.crashed = asyncio.Event()  # a scheduler hit an exception: SGLang's server goes down with it

    @property
    def session_ids(self) -> list[str]:
        return [t.session_id for t in self.transfers]

    async def run(self, inp: GenerateInput, on_progress: OnProgress | None = None) -> Outcome:
        """Run one request to the end. Raises GenerationError (SGLang's status and message)."""
        out = Outcome(inp.rid, len(inp.input_ids))
        out.top_logprobs_num, out.text_in_logprobs = inp.top_logprobs_num, inp.return_text_in_logprobs
        started = time.monotonic()
        if self.cfg.mode == "prefill":
            await self._run_prefill(inp, out)
        else:
            await self._run_decode(inp, out, on_progress)
        self.metrics.num_requests.inc()
        self.metrics.e2e_latency.observe(time.monotonic() - started)
        return out

    async def _run_prefill(self, inp: GenerateInput, out: Outcome) -> None:
        if not self.prefill_ranks or inp.bootstrap is None:
            raise GenerationError("prefill mode requires bootstrap fields", 400)
        room = inp.bootstrap.room
        dp_rank = room % self.cfg.attn_dp_size
        try:
            # The batch that finishes the prompt computes the first token (SGLang: on the prefill server): its
            # variant goes to the decode with the success outcome.
            first = await self.engines[dp_rank].prefill(inp.prompt, admitted=False)
            out.cached_tokens = first.cached_tokens
            message = {
                "op": "prefill",
                "room": room,
                "ids": inp.prompt.ids,
                "words": inp.prompt.words,
                "first": first.to_json(),
            }
            remote = [self._call(node, message, TransferFailedError) for node in self._remote_nodes[dp_rank]]
            await run_together([self._prefill_here(dp_rank, room, inp.prompt, first), *remote])
        except TransferFailedError as err:
            raise GenerationError(
                f"Prefill transfer failed for request rank=0 req.rid={inp.rid!r} req.bootstrap_room={room} "
                f"with exception {KVTransferError(room, str(err))}",
                500,
            ) from None
        out.finish_reason = {"type": "length", "length": 0}

    def _decode_rank(self, routed: int | None) -> int:
        """The client's ``routed_dp_rank`` (checked as SGLang 0.5.23 ``TokenizerManager.generate_request`` does:
        0 without attention DP is ignored, otherwise out of range is a 400), else the next group round robin."""
        size = self.cfg.attn_dp_size
        if routed is None or (size <= 1 and routed == 0):
            return next(self._turn)
        if not 0 <= routed < size:
            raise GenerationError(f"routed_dp_rank={routed} out of range [0, {size})", 400)
        return routed

    async def _run_decode(self, inp: GenerateInput, out: Outcome, on_progress: OnProgress | None) -> None:
        req = RunningRequest(inp.rid, inp.prompt, inp.params, top_logprobs=out.top_logprobs_num)
        dp_rank = self._decode_rank(inp.routed_dp_rank)
        engine = self.engines[dp_rank]
        try:
            await engine.admit(req)
        except OutOfPagesError as err:
            raise GenerationError(f"Request does not fit the KV cache: {err}", 400) from None
        received = False
        pd = bool(self.decode_ranks)
        try:
            first: PrefillVariant | None  # the prefill batch that computed the first token
            if pd:
                first = await self._receive(inp, req, dp_rank)
            else:
                first = await engine.prefill(inp.prompt)
                out.cached_tokens = first.cached_tokens
                engine.write_prompt_kv_locally(req)
            received = True
            first_at = time.monotonic()
            stops = inp.params.stop

            async def on_token(token: int, word: str) -> bool:
                out.output_ids.append(token)
                if len(out.output_ids) == 1:
                    self.metrics.ttft.observe(first_at - out.started)
                if req.top_logprobs is not None:
                    out.add_logprobs(req.output_logprobs[-1], word, len(out.output_ids) > 1 or inp.continues_text)
                before = len(out.text)
                text = f"{out.text} {word}" if out.text or inp.continues_text else word
                for stop in stops:
                    cut = text.find(stop, max(0, before - len(stop)))
                    if cut >= 0:
                        out.text = text[:cut].rstrip()
                        out.finish_reason = {"type": "stop", "matched": stop}
                        return False
                out.text = text
                if on_progress is not None:
                    await on_progress(out)
                return True

            reason = await engine.decode(req, on_token, first)
            if out.finish_reason is None:
                if reason == "stop":
                    out.finish_reason = {"type": "stop", "matched": model.EOS_ID}
                else:
                    out.finish_reason = {"type": "length", "length": len(out.output_ids)}
        finally:
            if pd and inp.bootstrap is not None and not received:
                # SGLang's deferred decode KV release: the pages stay held until the prefill stopped writing.
                task = asyncio.get_running_loop().create_task(self._deferred_release(inp.bootstrap.room, req, dp_rank))
                self._background.add(task)
                task.add_done_callback(self._background.discard)
            else:
                await engine.release(req)

    async def _prefill_here(
        self, dp_rank: int, room: int, prompt: model.Tokens, first: PrefillVariant | None = None
    ) -> None:
        group = self._prefill_by_dp.get(dp_rank)
        if group:
            kv = group[0].prompt_kv(prompt)  # every rank computes the same rows; each sends its part
            await run_together([rank.prefill(room, kv, first) for rank in group])

    async def _call(self, node: int, message: dict[str, Any], error: Callable[[str], Exception]) -> dict[str, Any]:
        """Run ``message`` on the ranks of ``node`` (SGLang: TP rank 0 broadcasts the batch to the TP group)."""
        assert self.group is not None
        try:
            reply = await self.group.call(node, message)
        except ConnectionError as err:
            raise error(str(err)) from None
        if reply.get("error"):
            raise error(str(reply["error"]))
        return reply

    async def serve_call(self, message: dict[str, Any]) -> dict[str, Any]:
        """A node > 0 runs node 0's call on its own ranks; errors travel back in the answer."""
        dp_rank = int(message.get("dp", message["room"] % self.cfg.attn_dp_size))
        if message["op"] == "prefill":
            try:
                prompt = model.Tokens(message["ids"], message["words"])
                first = PrefillVariant.from_json(message.get("first"))
                await self._prefill_here(dp_rank, int(message["room"]), prompt, first)
            except TransferFailedError as err:
                return {"error": str(err)}
            return {"error": None}
        pages = [int(p) for p in message["pages"]]
        ranks = self._decode_by_dp[dp_rank]
        try:
            firsts = await run_together(
                [r.receive_kv(int(message["room"]), message["host"], int(message["port"]), pages) for r in ranks]
            )
        except SchedulerCrashError as err:
            log.error(f"Scheduler hit an exception: RuntimeError: {err}")
            self.crashed.set()
            return {"error": str(err)}
        except KVTransferError as err:
            return {"error": err.reason}
        n = int(message["tokens"])
        first = next((f for f in firsts if f is not None), None)
        return {
            "error": None,
            "rows": {str(r.rank.attn_tp_rank): r.pool.read(pages, 0, n).tobytes().hex() for r in ranks},
            "first": None if first is None else first.to_json(),
        }

    async def _receive_remote(
        self, node: int, message: dict[str, Any], room: int, pages: list[int]
    ) -> PrefillVariant | None:
        reply = await self._call(node, message, lambda reason: KVTransferError(room, reason))
        engine = self.engines[int(message["dp"])]
        for attn_tp_rank, rows in reply["rows"].items():
            shard = engine.pool.shards[int(attn_tp_rank)]
            data = np.frombuffer(bytes.fromhex(rows), dtype=np.uint8).reshape(-1, shard.kv_bytes)
            shard.write(pages, 0, data)
        return PrefillVariant.from_json(reply.get("first"))

    async def _deferred_release(self, room: int, req: RunningRequest, dp_rank: int) -> None:
        await asyncio.gather(*(rank.quiesce(room) for rank in self._decode_by_dp[dp_rank]))
        await self.engines[dp_rank].release(req)

    async def _receive(self, inp: GenerateInput, req: RunningRequest, dp_rank: int) -> PrefillVariant | None:
        """Receive the prompt's KV from the prefill; returns the variant of the prefill batch that computed the first
        token (SGLang computes it on the prefill), None if the prefill did not say (step 0 then runs unperturbed)."""
        if inp.bootstrap is None:
            raise GenerationError("decode mode requires bootstrap fields", 400)
        b = inp.bootstrap
        port = b.port if b.port is not None else self.cfg.bootstrap_port
        message = {
            "op": "receive",
            "dp": dp_rank,
            "room": b.room,
            "host": b.host,
            "port": port,
            "pages": req.pages,
            "tokens": req.prompt_len,
        }
        local = [rank.receive_kv(b.room, b.host, port, req.pages) for rank in self._decode_by_dp[dp_rank]]
        remote = [self._receive_remote(node, message, b.room, req.pages) for node in self._remote_nodes[dp_rank]]
        try:
            firsts = await run_together([*local, *remote])
        except SchedulerCrashError as err:
            log.error(f"Scheduler hit an exception: RuntimeError: {err}")
            self.crashed.set()
            raise GenerationError(str(err), 500) from None
        except KVTransferError as err:
            raise GenerationError(
                f"Decode transfer failed for request rank=0 decode_req.req.rid={inp.rid!r} "
                f"decode_req.req.bootstrap_room={b.room} with exception {err}",
                500,
            ) from None
        return next((f for f in firsts if f is not None), None)

    def flush_cache(self) -> None:
        for engine in self.engines.values():
            if engine.radix is not None:
                engine.radix.reset()

    def gen_throughput(self) -> float:
        return sum(engine.gen_throughput() for engine in self.engines.values())

    def internal_states(self) -> list[dict[str, Any]]:
        """One entry per rank (per DP group in aggregated mode): its DP group's engine state and its PD state."""
        sides: list[PrefillSide | DecodeSide] = [*self.prefill_ranks, *self.decode_ranks]
        if not sides:
            return [dict(engine.internal_state()) for engine in self.engines.values()]
        return [{**self.engines[side.rank.attn_dp_rank].internal_state(), **side.internal_state()} for side in sides]

    def _open_stores(self) -> None:
        """HiCache's Mooncake Store of every prefill rank, once every rank's PD engine is up: SGLang's cache
        controller opens it after the weights loaded, long after each scheduler started its PD engine."""
        if self.cfg.mooncake_store_env is None:
            return
        for side in self.prefill_ranks:
            try:
                side.l3 = open_store(self.cfg, side.rank, side.transfer)
            except Exception as err:
                self.close_transfers()
                raise RankStartError(side.rank.tp_rank, err) from err

    def close_transfers(self) -> None:
        for side in self.prefill_ranks:
            if isinstance(side.l3, MooncakeL3):
                side.l3.close()
        for transfer in self.transfers:
            transfer.close()

    async def close(self) -> None:
        for task in list(self._background):
            task.cancel()
        for decode in self.decode_ranks:
            await decode.close()
        for engine in self.engines.values():
            await engine.stepper.close()
        self.close_transfers()
