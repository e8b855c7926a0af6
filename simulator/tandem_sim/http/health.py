"""SGLang 0.5.23's health endpoints and server status: ``/health``, ``/health_generate``, ``/ready``.

What SGLang does (``sglang/srt/entrypoints/http_server.py``: ``health_generate``, ``ready``;
``managers/tokenizer_manager.py``: ``is_healthy``, ``is_ready``, ``handle_loop``; ``managers/scheduler.py``:
``process_input_requests``, ``is_fully_idle``, ``maybe_send_health_check_signal``):

- ``/health`` and ``/health_generate`` are one handler: 503 while the server starts (``ServerStatus.Starting``) or
  exits; ``/health`` answers 200 at once when ``SGLANG_ENABLE_HEALTH_ENDPOINT_GENERATION`` is false; otherwise it
  sends a one-token request and waits up to ``SGLANG_HEALTH_CHECK_TIMEOUT`` (20 s) for *any* output of the
  scheduler (``last_receive_tstamp`` moves past the request's start): then 200 and status ``Up``, else 503 and
  status ``UnHealthy``.
- The scheduler does not run that request when it is busy (``is_fully_idle(for_health_check=True)`` is false: a
  running batch, a chunked or waiting prompt): it answers after its next batch, prefill chunk or decode step
  (``maybe_send_health_check_signal``, "to prevent the health check signal being blocked by long context
  prefill"). So a busy scheduler answers within one batch, and only a batch longer than the timeout, or a
  scheduler that stopped, fails the check. An idle scheduler runs the request: a one-token batch. A prefill server
  sends it to DP rank 0 (``follow_bootstrap_room``, room 0), others round robin (``dispatch_health_check``).
- ``/ready`` (200 or 503, no body) is ``is_ready()``: not paused, status ``Up``, not exiting. It runs nothing, so
  it is cheap; it turns 503 when a health check failed and 200 again when one passes.

- ``/pause_generation`` (``TokenizerManager.pause_generation``) sets ``is_pause``: ``/ready`` answers 503, new
  requests (health checks too) wait in the tokenizer until ``/continue_generation``; mode ``abort`` (the default)
  aborts what runs, ``in_place`` and ``retract`` stop the scheduler where it is.

Modelled here: a finished batch of any of the node's schedulers is scheduler output (SGLang: any output reaching
the tokenizer, which intermediate prefill chunks of other DP ranks do not send); a hung scheduler
(``Stepper.hang``) finishes none. Not modelled: the handler's 1 s polling (the simulator answers at once),
``retract`` putting running requests back in the queue (kept in place), and exiting (the simulator stops at
SIGTERM without SGLang's drain).
"""

from __future__ import annotations

import asyncio
import itertools
from collections.abc import Callable
from enum import Enum

from tandem_sim.engine.stepper import Stepper


class ServerStatus(Enum):
    STARTING = "Starting"
    UP = "Up"
    UNHEALTHY = "UnHealthy"


class Health:
    """The tokenizer manager's health state and the generation check, over the node's schedulers."""

    def __init__(
        self,
        steppers: list[Stepper],
        *,
        prefill: bool,
        timeout_s: float,
        generation_on_health: bool,
        started: Callable[[], bool],
        slow_s: Callable[[], float] = lambda: 0.0,
    ) -> None:
        self.steppers = steppers
        self.timeout_s = timeout_s
        self.generation_on_health = generation_on_health
        self.started = started
        self.slow_s = slow_s  # --sim-slow-health-s while requests run: an extra delay before the check is answered
        self.status = ServerStatus.STARTING
        self._unpaused = asyncio.Event()
        self._unpaused.set()
        self._route = itertools.repeat(0) if prefill else itertools.cycle(range(len(steppers)))

    def _current(self) -> ServerStatus:
        if self.status is ServerStatus.STARTING and self.started():
            self.status = ServerStatus.UP  # the simulator has no warmup request: up once its group formed
        return self.status if self.started() else ServerStatus.STARTING

    @property
    def paused(self) -> bool:
        return not self._unpaused.is_set()

    def pause(self, on: bool) -> None:
        """``/pause_generation`` (True), ``/continue_generation`` (False): the tokenizer's ``is_pause``."""
        if on:
            self._unpaused.clear()
        else:
            self._unpaused.set()

    async def wait_unpaused(self) -> None:
        """A request waits in the tokenizer while generation is paused (``is_pause_cond``)."""
        await self._unpaused.wait()

    def ready(self) -> bool:
        """``/ready``: ``TokenizerManager.is_ready`` (not paused, status ``Up``)."""
        return not self.paused and self._current() is ServerStatus.UP

    async def check(self, path: str) -> int:
        """``/health`` or ``/health_generate``: the HTTP status."""
        if self._current() is ServerStatus.STARTING:
            return 503
        if path == "/health" and not self.generation_on_health:
            return 200
        try:
            async with asyncio.timeout(self.timeout_s):
                await self.wait_unpaused()
                await self._scheduler_output()
        except TimeoutError:
            self.status = ServerStatus.UNHEALTHY
            return 503
        self.status = ServerStatus.UP
        return 200

    async def _scheduler_output(self) -> None:
        """Return at the next scheduler output: any scheduler's next batch, or the check's own one-token batch when
        the scheduler it is sent to is idle."""
        if (delay := self.slow_s()) > 0:
            await asyncio.sleep(delay)
        target = self.steppers[next(self._route)]
        waits: set[asyncio.Future[None]] = {asyncio.shield(s.next_batch()) for s in self.steppers}
        if target.idle:
            waits.add(asyncio.ensure_future(target.health_batch()))
        try:
            await asyncio.wait(waits, return_when=asyncio.FIRST_COMPLETED)
        finally:
            for wait in waits:
                wait.cancel()
