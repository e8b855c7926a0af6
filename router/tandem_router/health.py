"""Active health checks: probe every worker's ``/health``, scrape decode load from ``/metrics``, learn models.

A refused connection opens the worker's breaker at once; a probe that times out or answers non-200 counts as
one failure (a worker busy with hundreds of streams answers ``/health`` slowly but is not dead: its completed
requests keep resetting the count). A successful probe closes the breaker. Load and model names feed the
policies and the request validation.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import time

import orjson

from tandem.registry import Role
from tandem_router.policy.load import parse_sglang_metrics
from tandem_router.pool import WorkerPool, WorkerState
from tandem_router.transport import Transport, WorkerError

log = logging.getLogger("tandem.router.health")


class HealthChecker:
    def __init__(self, pool: WorkerPool, transport: Transport, interval: float = 2.0) -> None:
        self.pool = pool
        self.transport = transport
        self.interval = interval
        self._task: asyncio.Task[None] | None = None

    def start(self) -> None:
        self._task = asyncio.create_task(self._loop())

    async def stop(self) -> None:
        if self._task is not None:
            self._task.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await self._task

    async def check_all(self) -> None:
        self.transport.retain({w.spec.url for w in self.pool.workers.values()})  # drop connections to removed ones
        await asyncio.gather(*(self.check(w) for w in list(self.pool.workers.values())))

    async def check(self, worker: WorkerState) -> None:
        spec = worker.spec
        hard = False
        try:
            status, _ = await self.transport.get(spec.url, "/health")
            ok = status == 200
        except WorkerError as err:
            ok, hard = False, err.hard  # a probe timeout is soft: a busy worker is slow, not dead
            log.debug("health probe failed", extra={"worker": spec.url, "error": str(err)})
        if spec.key not in self.pool.workers:
            return  # removed while we probed
        self.pool.record_worker(spec, ok, time.monotonic(), hard=hard)
        if not ok:
            log.warning(
                "worker failed its health probe",
                extra={"worker": spec.url, "role": spec.role.value, "unreachable": hard},
            )
            return
        if not worker.models:
            worker.models = await self._models(spec.url)
        if spec.role is Role.DECODE:
            with contextlib.suppress(WorkerError, ValueError):
                status, text = await self.transport.get(spec.url, "/metrics")
                if status == 200:
                    worker.load = parse_sglang_metrics(text.decode(errors="replace"))

    async def _models(self, url: str) -> frozenset[str]:
        try:
            status, body = await self.transport.get(url, "/v1/models")
            if status != 200:
                return frozenset()
            data = orjson.loads(body).get("data", [])
            return frozenset(m["id"] for m in data if isinstance(m, dict) and isinstance(m.get("id"), str))
        except (WorkerError, orjson.JSONDecodeError, AttributeError):
            return frozenset()

    async def _loop(self) -> None:
        while True:
            try:
                await self.check_all()
            except Exception:
                log.exception("health check round failed")
            await asyncio.sleep(self.interval)
