"""Continuous batching of one attention-DP group: the simulated GPU runs one batch at a time.

Modelled on SGLang 0.5.23's scheduler loop (``managers/scheduler.py``: ``Scheduler.event_loop_normal``,
``get_next_batch_to_run``; ``managers/schedule_policy.py``: ``PrefillAdder``):

- a prefill batch is formed whenever prompts wait (prefill first, as ``get_next_batch_to_run`` does without
  ``--enable-mixed-chunk``); it takes waiting prompts in arrival order up to ``--max-prefill-tokens`` uncached
  tokens, and a prompt longer than what is left of ``--chunked-prefill-size`` is cut into chunks, one chunk per
  batch (the ``chunked_req``), so a long prompt does not hold the GPU for its whole length;
- otherwise one decode step runs for every sequence that asked for its next token; sequences that ask during a
  step join the next one (requests join and leave the running batch between steps).

A step's duration comes from the profile (``model/profiles.py``): prefill ``base + per_token * tokens``; decode
``base + per_seq * B + per_kv_token * sum(context)``. The stepper decides *when* a request's work is done, and
tells it what the kernels saw (``model/numerics.py``): a decode step returns its ``DecodeVariant`` (the batch size
padded to its CUDA graph), a prefill the ``PrefillVariant`` of the batch that finished the prompt; without
``--enable-deterministic-inference`` those change the greedy output at near-ties, as on a GPU.

Health (``http/health.py``): every finished batch is scheduler output (``next_batch`` resolves), which is what SGLang's
``/health`` waits for; a scheduler that is not fully idle answers a health check after its next batch
(``Scheduler.maybe_send_health_check_signal``), an idle one runs the check's one-token batch (``health_batch``).
``hang()`` stops the loop where it is, as a scheduler stuck in a kernel or a collective: the batch in flight never
finishes, no batch follows, the requests stay where they are; ``resume()`` lets it go on.
"""

from __future__ import annotations

import asyncio
from collections import deque
from collections.abc import Callable
from dataclasses import dataclass

from tandem_sim.model.numerics import DecodeVariant, Numerics, PrefillVariant
from tandem_sim.model.profiles import SimProfile

GATHER_TURNS = 64  # event-loop turns a step waits for running sequences to ask for their next token


@dataclass(eq=False)
class _Prefill:
    remaining: int
    done: asyncio.Future[PrefillVariant]
    cached: int = 0  # the prompt's radix-cached tokens (skipped)
    chunks: int = 0  # chunks cut off the prompt before the batch that finishes it
    health: bool = False  # SGLang's health-check request (its batches are not counted: _record_step_counters)


@dataclass
class StepStats:
    """What the loop did (tests and ``/get_internal_state``)."""

    prefill_batches: int = 0
    prefill_chunks: int = 0
    decode_steps: int = 0
    max_decode_batch: int = 0


class Stepper:
    def __init__(
        self,
        profile: SimProfile,
        max_prefill_tokens: int,
        chunked_prefill_size: int,
        on_decode_step: Callable[[int], None] | None = None,
        numerics: Numerics | None = None,
    ) -> None:
        self.profile = profile
        self.max_prefill_tokens = max_prefill_tokens
        # -1 (SGLang: chunking disabled) means a prompt is never cut: the prefill budget alone limits the batch.
        self.chunk = chunked_prefill_size if chunked_prefill_size > 0 else 0
        self.on_decode_step = on_decode_step
        self.numerics = Numerics() if numerics is None else numerics
        self._prefills: deque[_Prefill] = deque()
        self._decoders: list[tuple[int, asyncio.Future[DecodeVariant]]] = []
        self._loop_task: asyncio.Task[None] | None = None
        self._members = 0  # sequences in their decode phase (the running batch)
        self.stats = StepStats()
        self._batch_done: asyncio.Future[None] | None = None  # resolved when the next batch finishes
        self._running = asyncio.Event()  # cleared while hung
        self._running.set()

    @property
    def waiting_prefills(self) -> int:
        return len(self._prefills)

    @property
    def idle(self) -> bool:
        """SGLang's ``Scheduler.is_fully_idle(for_health_check=True)``: no running batch, no chunked or waiting
        prompt, no batch in flight."""
        loop_busy = self._loop_task is not None and not self._loop_task.done()
        return not (self._prefills or self._decoders or self._members or loop_busy)

    def hang(self) -> None:
        """The scheduler stops where it is (``--sim-inject-hang-after-s``, ``/tandem/sim/faults``)."""
        self._running.clear()

    def resume(self) -> None:
        self._running.set()

    def next_batch(self) -> asyncio.Future[None]:
        """Resolves when the next batch finishes (scheduler output: SGLang's ``last_receive_tstamp`` moves)."""
        if self._batch_done is None or self._batch_done.done():
            self._batch_done = asyncio.get_running_loop().create_future()
        return self._batch_done

    async def health_batch(self) -> None:
        """The health check's own request on an idle scheduler: one token through a prefill batch."""
        job = _Prefill(1, asyncio.get_running_loop().create_future(), health=True)
        self._prefills.append(job)
        self._kick()
        try:
            await asyncio.shield(job.done)
        finally:
            if job in self._prefills:
                self._prefills.remove(job)

    async def prefill(self, tokens: int, cached: int = 0) -> PrefillVariant:
        """Return once ``tokens`` prompt tokens (the uncached part; ``cached`` more came from the radix cache) went
        through prefill batches: the variant of the batch that finished the prompt (it computes the first token)."""
        if tokens <= 0:
            return PrefillVariant(0, 0, cached)
        job = _Prefill(tokens, asyncio.get_running_loop().create_future(), cached)
        self._prefills.append(job)
        self._kick()
        try:
            return await asyncio.shield(job.done)
        except asyncio.CancelledError:
            if job in self._prefills:
                self._prefills.remove(job)  # an aborted request leaves the waiting queue
            raise

    async def decode_step(self, context_tokens: int) -> DecodeVariant:
        """Return after the next decode step that includes this sequence (``context_tokens`` attended): the step's
        variant (its batch size, padded to the CUDA graph it replays)."""
        done: asyncio.Future[DecodeVariant] = asyncio.get_running_loop().create_future()
        self._decoders.append((context_tokens, done))
        self._kick()
        return await done

    def _kick(self) -> None:
        if self._loop_task is None or self._loop_task.done():
            self._loop_task = asyncio.get_running_loop().create_task(self._run())

    def join(self) -> None:
        """A sequence enters the running batch (its decode phase starts)."""
        self._members += 1

    def leave(self) -> None:
        self._members -= 1

    async def _run(self) -> None:
        while True:
            if self._prefills:
                await self._prefill_batch()
                continue
            await self._gather_running_batch()
            if self._prefills:
                continue
            if not self._decoders:
                return
            await self._decode_batch()

    async def _gather_running_batch(self) -> None:
        """Every running sequence takes part in each step: give the sequences that just got their token a few
        loop turns to ask for the next one (a sequence stuck on a slow client is left for the next step, as
        SGLang's scheduler never waits for clients)."""
        for _ in range(GATHER_TURNS):
            if len(self._decoders) >= self._members or self._prefills:
                return
            await asyncio.sleep(0)

    def _form_prefill_batch(self) -> tuple[int, list[_Prefill]]:
        """Take prompts in order up to the budgets; the first prompt that does not fit the chunk is chunked."""
        budget = self.max_prefill_tokens
        chunk_left = self.chunk or budget
        taken, finished = 0, []
        for job in list(self._prefills):
            room = min(budget - taken, chunk_left - taken)
            if room <= 0:
                break
            if job.remaining <= room:
                taken += job.remaining
                job.remaining = 0
                finished.append(job)
                continue
            if self.chunk == 0:
                if taken > 0:
                    break  # without chunking a prompt that does not fit waits for the next batch
                # ... and one that exceeds the budget alone runs whole: PrefillAdder admits the first request of a
                # batch whatever --max-prefill-tokens says, and without a chunk limit it is never cut
                taken = job.remaining
                job.remaining = 0
                finished.append(job)
                break
            job.remaining -= room  # SGLang's chunked_req: one chunk now, the rest in later batches
            job.chunks += 1
            self.stats.prefill_chunks += 1
            taken += room
            break
        return taken, finished

    async def _prefill_batch(self) -> None:
        taken, finished = self._form_prefill_batch()
        if not finished or not all(job.health for job in finished):
            self.stats.prefill_batches += 1
        await asyncio.sleep(self.profile.prefill_s(taken))
        await self._batch_finished()
        for job in finished:
            if job in self._prefills:  # an aborted request left the queue while its last batch ran
                self._prefills.remove(job)
            if not job.done.done():
                job.done.set_result(PrefillVariant(taken, job.chunks + 1, job.cached))

    async def _decode_batch(self) -> None:
        batch, self._decoders = self._decoders, []
        size = len(batch)
        self.stats.decode_steps += 1
        self.stats.max_decode_batch = max(self.stats.max_decode_batch, size)
        await asyncio.sleep(self.profile.decode_s(size, sum(tokens for tokens, _ in batch)))
        await self._batch_finished()
        variant = self.numerics.decode_variant(size)
        for _, done in batch:
            if not done.done():
                done.set_result(variant)
        if self.on_decode_step is not None:
            self.on_decode_step(size)

    async def _batch_finished(self) -> None:
        """The batch is over (scheduler output) unless the scheduler hangs: then it waits here, never done."""
        await self._running.wait()
        if self._batch_done is not None and not self._batch_done.done():
            self._batch_done.set_result(None)

    async def close(self) -> None:
        if self._loop_task is not None:
            self._loop_task.cancel()
            await asyncio.gather(self._loop_task, return_exceptions=True)
