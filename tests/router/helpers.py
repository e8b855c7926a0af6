"""Real loopback servers for router tests: instant PD workers and the router itself, in the test's event loop."""

from __future__ import annotations

import sys
from collections.abc import AsyncIterator, Sequence
from contextlib import asynccontextmanager
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import aiohttp
from aiohttp import web

from tandem_dev.procs import ManagedProcess, free_port
from tandem_dev.router import instant_worker
from tandem_router.app import RouterApp, build_app, state_of
from tandem_router.config import PrefillSpec, RouterSettings
from tandem_router.integrity.monitor import IntegrityMonitor
from tandem_router.integrity.probe_budget import ProbeBudget, ProbeMetrics
from tandem_router.policy.selection import Policy
from tandem_router.probes.canary import ProbeScope
from tandem_router.server import HttpServer


@dataclass
class Served:
    runner: web.AppRunner
    url: str

    @property
    def app(self) -> web.Application:
        return self.runner.app


async def serve(app: web.Application) -> Served:
    runner = web.AppRunner(app, access_log=None, shutdown_timeout=2.0)
    await runner.setup()
    site = web.TCPSite(runner, "127.0.0.1", 0)
    await site.start()
    host, port = runner.addresses[0][:2]
    return Served(runner, f"http://{host}:{port}")


@dataclass
class ServedRouter:
    app: RouterApp
    server: HttpServer
    url: str

    async def stop(self) -> None:
        await self.app.stop(self.server, 2.0)


async def serve_router(settings: RouterSettings) -> ServedRouter:
    """The router as ``tandem router`` serves it (its own HTTP server), on a free loopback port."""
    app = build_app(settings)
    server = await app.start("127.0.0.1", 0)
    host, port = server.address
    return ServedRouter(app, server, f"http://{host}:{port}")


@dataclass
class Stack:
    prefills: list[Served]
    decodes: list[Served]
    router: ServedRouter
    http: aiohttp.ClientSession

    @property
    def state(self) -> Any:
        return state_of(self.router.app)

    async def faults(self, worker: Served, **faults: Any) -> None:
        async with self.http.post(f"{worker.url}/_faults", json=faults) as resp:
            assert resp.status == 200

    async def received(self, worker: Served) -> list[dict[str, Any]]:
        async with self.http.get(f"{worker.url}/_requests") as resp:
            recent: list[dict[str, Any]] = (await resp.json())["recent"]
            return recent

    async def post(self, path: str, body: Any, headers: dict[str, str] | None = None) -> tuple[int, bytes]:
        async with self.http.post(f"{self.router.url}{path}", json=body, headers=headers) as resp:
            return resp.status, await resp.read()


@asynccontextmanager
async def stack(
    prefills: int = 2,
    decodes: int = 2,
    *,
    bootstrap_ports: Sequence[int | None] | None = None,
    dead_prefills: Sequence[str] = (),
    **settings: Any,
) -> AsyncIterator[Stack]:
    """``prefills`` + ``decodes`` instant workers and a router in front of them (plus ``dead_prefills`` URLs)."""
    ps = [await serve(instant_worker.build_app("prefill")) for _ in range(prefills)]
    ds = [await serve(instant_worker.build_app("decode")) for _ in range(decodes)]
    ports = list(bootstrap_ports or [8998 + i for i in range(prefills)])
    # Settings by name, grouped ones by their flat (flag) name: integrity=True, canary_interval_s=5.
    cfg = RouterSettings.model_validate(
        {
            "prefill": [PrefillSpec(url=p.url, bootstrap_port=port) for p, port in zip(ps, ports, strict=True)]
            + [PrefillSpec(url=u) for u in dead_prefills],
            "decode": [d.url for d in ds],
            "policy": settings.pop("policy", Policy.ROUND_ROBIN),
            "health_interval_s": settings.pop("health_interval_s", 60.0),
            # Canaries would add requests the instant-worker tests count; the integrity tests turn them on.
            "integrity": settings.pop("integrity", False),
            "retry_initial_backoff_s": settings.pop("retry_initial_backoff_s", 0.001),
            **settings,
        }
    )
    router = await serve_router(cfg)
    http = aiohttp.ClientSession()
    try:
        yield Stack(ps, ds, router, http)
    finally:
        await http.close()
        await router.stop()
        for w in ps + ds:
            await w.runner.cleanup()


def start_instant_workers(procs: list[ManagedProcess], logs: Path) -> dict[str, str]:
    """A prefill and a decode instant worker, each its own process (appended to ``procs``, which the caller
    stops), by role -> URL once each answers ``/health``."""
    urls = {}
    for role in ("prefill", "decode"):
        port = free_port()
        argv = [sys.executable, "-m", "tandem_dev.router.instant_worker", "--role", role, "--port", str(port)]
        procs.append(ManagedProcess(role, argv, logs / f"{role}.log").start())
        urls[role] = f"http://127.0.0.1:{port}"
        procs[-1].wait_http(urls[role] + "/health")
    return urls


def ample_budget(monitor: IntegrityMonitor) -> ProbeBudget:
    """A probing budget that never cuts a round or a burst (a cluster of 10,000 request slots), for tests of
    what the prober decides rather than of how much it may send."""
    return ProbeBudget(1.0, lambda: 10_000.0, ProbeMetrics(monitor.metrics.registry))


def lone_router() -> ProbeScope:
    """The scope of a router that is alone in its cluster and has nothing to probe first."""
    return ProbeScope("router-0", lambda: {"router-0"}, lambda pair: False)
