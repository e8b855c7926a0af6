"""Active health checks: a refused connection opens a worker at once, a slow probe only counts one failure."""

from __future__ import annotations

import socket

from tandem.registry import Role
from tandem_dev.procs import free_port
from tandem_router.health import HealthChecker
from tandem_router.policy.breaker import BreakerConfig, BreakerState
from tandem_router.pool import WorkerPool, WorkerSpec
from tandem_router.transport import Transport, TransportConfig


async def test_refused_opens_at_once_but_a_silent_worker_needs_the_threshold() -> None:
    silent = socket.socket()
    silent.bind(("127.0.0.1", 0))
    silent.listen(16)  # accepts connections in the kernel, never answers: a probe times out
    dead = WorkerSpec(Role.DECODE, f"http://127.0.0.1:{free_port()}")
    slow = WorkerSpec(Role.DECODE, f"http://127.0.0.1:{silent.getsockname()[1]}")
    pool = WorkerPool(breaker_cfg=BreakerConfig(threshold=2, cooldown=60))
    pool.replace_all([dead, slow])
    transport = Transport(TransportConfig(probe_timeout=0.2))
    checker = HealthChecker(pool, transport)
    try:
        await checker.check_all()
        assert pool.workers[dead.key].breaker.state is BreakerState.OPEN
        assert pool.workers[slow.key].breaker.state is BreakerState.CLOSED
        await checker.check_all()
        assert pool.workers[slow.key].breaker.state is BreakerState.OPEN
    finally:
        await transport.close()
        silent.close()
