"""End-to-end router overhead on simulated workers (real PD protocol, real Mooncake KV transfer).

One simulated prefill + decode pair is driven at concurrency 1, 64 and 256 two ways in the same run: by a client
that does the PD fan-out itself (the floor: no router), and through Tandem's router. The table shows the TTFT the
router adds (p50/p99) and the throughput of both. The load generator is an aiohttp client: the simulated workers,
not the client, bound throughput here (a few hundred requests/s at most on 2 cores).
"""

from __future__ import annotations

import asyncio
import random
import sys
import time
from collections.abc import Awaitable, Callable
from dataclasses import dataclass
from pathlib import Path

import aiohttp

from tandem_dev.bench import BenchArgs, Plot, Table
from tandem_dev.procs import ManagedProcess, free_port

HOST = "127.0.0.1"
MODEL = "tandem/sim-model"


@dataclass
class Run:
    ttft_ms: list[float]
    seconds: float
    errors: int

    def pct(self, q: float) -> float:
        s = sorted(self.ttft_ms)
        return s[min(len(s) - 1, int(len(s) * q))] if s else float("nan")

    @property
    def rps(self) -> float:
        return len(self.ttft_ms) / self.seconds if self.seconds else 0.0


def _body(i: int) -> dict[str, object]:
    return {"model": MODEL, "prompt": f"request {i} about prefill and decode", "max_tokens": 16, "temperature": 0,
            "stream": True}  # fmt: skip


async def stream_ttft(http: aiohttp.ClientSession, url: str, body: dict[str, object]) -> float:
    """POST a streamed request to ``url``: ms to its first chunk (after reading it all). Raises on an error."""
    started = time.perf_counter()
    async with http.post(url, json=body) as resp:
        if resp.status != 200:
            raise RuntimeError(f"HTTP {resp.status}")
        first = 0.0
        async for chunk in resp.content.iter_any():
            if not first and chunk:
                first = time.perf_counter()
            if b'"error"' in chunk:
                raise RuntimeError(chunk[:200].decode(errors="replace"))
    return (first - started) * 1000


async def _drive(concurrency: int, n: int, one: Callable[[int], Awaitable[float]]) -> Run:
    sem = asyncio.Semaphore(concurrency)
    samples: list[float] = []
    errors = 0

    async def job(i: int) -> None:
        nonlocal errors
        async with sem:
            try:
                samples.append(await one(i))
            except (TimeoutError, RuntimeError, aiohttp.ClientError):
                errors += 1

    started = time.perf_counter()
    await asyncio.gather(*(job(i) for i in range(n)))
    return Run(samples, time.perf_counter() - started, errors)


async def _measure(prefill: str, bootstrap_port: int, decode: str, router: str, plan: list[tuple[int, int]]) -> Table:
    rng = random.Random(0)
    connector = aiohttp.TCPConnector(limit=0)
    async with aiohttp.ClientSession(connector=connector, timeout=aiohttp.ClientTimeout(total=120)) as http:

        async def direct(i: int) -> float:
            body = {**_body(i), "bootstrap_host": HOST, "bootstrap_port": bootstrap_port,
                    "bootstrap_room": rng.randint(0, 2**63 - 1)}  # fmt: skip

            async def to_prefill() -> None:
                async with http.post(f"{prefill}/v1/completions", json=body) as resp:
                    await resp.read()

            prefill_task = asyncio.create_task(to_prefill())
            ttft = await stream_ttft(http, f"{decode}/v1/completions", body)
            await prefill_task
            return ttft

        async def routed(i: int) -> float:
            return await stream_ttft(http, f"{router}/v1/completions", _body(i))

        table = Table(
            "end to end on simulated workers (1 prefill + 1 decode, 16 tokens, stream): router vs client-side PD",
            ["concurrency", "requests", "direct TTFT p50 ms", "router TTFT p50 ms", "added p50 ms", "added p99 ms",
             "direct req/s", "router req/s", "errors d/r"],
            plot=Plot("line", "concurrency", ["direct TTFT p50 ms", "router TTFT p50 ms"], "TTFT p50 ms", log_y=True),
        )  # fmt: skip
        for concurrency, n in plan:
            await _drive(min(concurrency, 8), min(n, 16), routed)  # warm both paths
            d = await _drive(concurrency, n, direct)
            r = await _drive(concurrency, n, routed)
            table.rows.append([
                concurrency, n, d.pct(0.5), r.pct(0.5), r.pct(0.5) - d.pct(0.5), r.pct(0.99) - d.pct(0.99),
                d.rps, r.rps, f"{d.errors}/{r.errors}",
            ])  # fmt: skip
        return table


def run(args: BenchArgs, workdir: Path) -> Table:
    plan = [(1, 30), (64, 128), (256, 256)] if args.quick else [(1, 200), (64, 1024), (256, 2048)]
    procs: list[ManagedProcess] = []
    py = sys.executable
    try:
        p_port, bootstrap, d_port, r_port = free_port(), free_port(), free_port(), free_port()
        sim = [py, "-m", "tandem.cli", "sim", "--model-path", MODEL, "--host", HOST, "--max-running-requests", "512"]
        for name, argv in (
            ("sim-prefill", [*sim, "--port", str(p_port), "--disaggregation-mode", "prefill",
                             "--disaggregation-bootstrap-port", str(bootstrap)]),
            ("sim-decode", [*sim, "--port", str(d_port), "--disaggregation-mode", "decode"]),
        ):  # fmt: skip
            procs.append(ManagedProcess(name, argv, workdir / f"{name}.log").start())
        for proc, port in zip(procs, (p_port, d_port), strict=True):
            proc.wait_http(f"http://{HOST}:{port}/health", timeout=120)
        prefill, decode, router = f"http://{HOST}:{p_port}", f"http://{HOST}:{d_port}", f"http://{HOST}:{r_port}"
        argv = [py, "-m", "tandem.cli", "router", "--port", str(r_port), "--prefill", prefill, str(bootstrap),
                "--decode", decode, "--log-level", "warning", "--max-concurrent-requests", "4096"]  # fmt: skip
        procs.append(ManagedProcess("router-e2e", argv, workdir / "router-e2e.log").start())
        procs[-1].wait_http(f"{router}/readiness", timeout=60)
        with asyncio.Runner() as runner:
            return runner.run(_measure(prefill, bootstrap, decode, router, plan))
    finally:
        for proc in reversed(procs):
            proc.stop()
