"""The resume gap under load: a decode killed while temperature-0 streams run through the router.

One simulated prefill and two decodes (real PD protocol, real Mooncake KV transfer) behind the router. Streams of
``TOKENS`` tokens run ``concurrency`` at a time, a third each of chat, completions and ``/generate``; once every
stream of the first batch got its first byte, one decode is killed (SIGKILL). The router resumes the streams it
cut on the other decode (``resume/``). The gap a client saw is the longest pause between two chunks of its
stream; per route, the resumed streams are the ones with the longest pauses, as many as the router counted
resumes of that route (``tandem_router_resumed_streams_total{route}``). The table shows their p50/p99 next to the
router's own histogram count, the streams that failed, and the ordinary longest pause of a stream that was not
resumed (the floor on a loaded machine).
"""

from __future__ import annotations

import asyncio
import signal
import sys
import time
from collections.abc import Sequence
from pathlib import Path

import aiohttp
from prometheus_client.parser import text_string_to_metric_families

from tandem_dev.bench import BenchArgs, Table
from tandem_dev.procs import ManagedProcess, free_port

HOST = "127.0.0.1"
MODEL = "tandem/sim-model"
TOKENS = 200
INTER_TOKEN_MS = "10"  # 2 s streams: the kill lands mid-stream


ROUTES = ("/v1/chat/completions", "/v1/completions", "/generate")


def _body(route: str, i: int) -> dict[str, object]:
    if route == "/generate":
        return {"text": f"stream {i}: tell me a long story", "stream": True,
                "sampling_params": {"max_new_tokens": TOKENS, "temperature": 0}}  # fmt: skip
    prompt: dict[str, object] = (
        {"messages": [{"role": "user", "content": f"stream {i}: tell me a long story"}]}
        if route == ROUTES[0]
        else {"prompt": f"stream {i}: once upon a time"}
    )
    return {"model": MODEL, **prompt, "max_tokens": TOKENS, "temperature": 0, "stream": True}


async def _stream(http: aiohttp.ClientSession, router: str, i: int, started: asyncio.Event | None) -> float:
    """Stream ``i`` (route ``i`` mod 3); returns its longest pause between chunks (s). Raises on an error event or
    status."""
    route = ROUTES[i % 3]
    async with http.post(f"{router}{route}", json=_body(route, i)) as resp:
        if resp.status != 200:
            raise RuntimeError(f"HTTP {resp.status}")
        last, gap = 0.0, 0.0
        async for chunk in resp.content.iter_any():
            if b'"error"' in chunk:
                raise RuntimeError(chunk[:200].decode(errors="replace"))
            now = time.perf_counter()
            if last:
                gap = max(gap, now - last)
            elif started is not None:
                started.set()
            last = now
    return gap


async def _resumes(http: aiohttp.ClientSession, router: str) -> tuple[dict[str, int], int]:
    """(streams resumed per route, resume gaps observed) from the router's metrics."""
    async with http.get(f"{router}/metrics") as resp:
        text = await resp.text()
    resumed = dict.fromkeys(ROUTES, 0)
    gaps = 0.0
    for family in text_string_to_metric_families(text):
        for sample in family.samples:
            if sample.name == "tandem_router_resumed_streams_total":
                resumed[sample.labels["route"]] += int(sample.value)
            elif sample.name == "tandem_router_resume_gap_seconds_count":
                gaps += sample.value
    return resumed, int(gaps)


def _pct(values: list[float], q: float) -> float:
    s = sorted(values)
    return s[min(len(s) - 1, int(len(s) * q))] if s else float("nan")


async def _measure(router: str, victim: ManagedProcess, concurrency: int) -> tuple[list[Sequence[object]], int]:
    async with aiohttp.ClientSession(timeout=aiohttp.ClientTimeout(total=120)) as http:
        await asyncio.gather(*(_stream(http, router, -i, None) for i in range(1, 7)))  # warm up, every route
        events = [asyncio.Event() for _ in range(concurrency)]
        tasks = [asyncio.create_task(_stream(http, router, i, events[i])) for i in range(concurrency)]
        await asyncio.wait_for(asyncio.gather(*(e.wait() for e in events)), 60)
        victim.signal(signal.SIGKILL)
        results = await asyncio.gather(*tasks, return_exceptions=True)
        resumed, observed = await _resumes(http, router)
    rows: list[Sequence[object]] = []
    for n, route in enumerate(ROUTES):
        mine = results[n::3]
        gaps = sorted(r for r in mine if isinstance(r, float))
        cut = gaps[len(gaps) - resumed[route] :] if resumed[route] else []
        rest = gaps[: len(gaps) - resumed[route]]
        rows.append([route, len(mine), resumed[route], len(mine) - len(gaps), _pct(cut, 0.5) * 1000,
                     _pct(cut, 0.99) * 1000, _pct(rest, 0.99) * 1000])  # fmt: skip
    return rows, observed


def run(args: BenchArgs, workdir: Path) -> Table:
    concurrency = 32 if args.quick else 64
    py = sys.executable
    procs: list[ManagedProcess] = []
    try:
        p_port, bootstrap, r_port = free_port(), free_port(), free_port()
        d_ports = [free_port(), free_port()]
        sim = [py, "-m", "tandem.cli", "sim", "--model-path", MODEL, "--host", HOST, "--max-running-requests", "512",
               "--sim-inter-token-ms", INTER_TOKEN_MS]  # fmt: skip
        specs = [("sim-prefill", p_port, ["--disaggregation-mode", "prefill", "--disaggregation-bootstrap-port",
                                          str(bootstrap)])]  # fmt: skip
        specs += [(f"sim-decode-{n}", port, ["--disaggregation-mode", "decode"]) for n, port in enumerate(d_ports)]
        for name, port, extra in specs:
            procs.append(ManagedProcess(name, [*sim, "--port", str(port), *extra], workdir / f"{name}.log").start())
        for proc, (_, port, _) in zip(procs, specs, strict=True):
            proc.wait_http(f"http://{HOST}:{port}/health", timeout=120)
        router = f"http://{HOST}:{r_port}"
        argv = [py, "-m", "tandem.cli", "router", "--port", str(r_port), "--prefill", f"http://{HOST}:{p_port}",
                str(bootstrap), "--log-level", "warning"]  # fmt: skip
        for port in d_ports:
            argv += ["--decode", f"http://{HOST}:{port}"]
        procs.append(ManagedProcess("router-resume", argv, workdir / "router-resume.log").start())
        procs[-1].wait_http(f"{router}/readiness", timeout=60)
        with asyncio.Runner() as runner:
            rows, observed = runner.run(_measure(router, procs[1], concurrency))
    finally:
        for proc in reversed(procs):
            proc.stop()
    return Table(
        f"resume gap: one of 2 decodes killed under {concurrency} temperature-0 streams, a third per route "
        f"({TOKENS} tokens, {INTER_TOKEN_MS} ms/token, router defaults: --resume-max-attempts 2)",
        [
            "route",
            "streams",
            "resumed",
            "failed streams",
            "resume gap p50 ms",
            "resume gap p99 ms",
            "longest pause p99, not resumed, ms",
        ],
        rows=rows,
        notes=[
            "gap as the client saw it: the longest pause between two chunks of each resumed stream "
            "(re-prefill of prompt + relayed tokens included); one kill per run, so p99 is about the maximum",
            f"the router observed {observed} resume gaps (tandem_router_resume_gap_seconds_count)",
        ],
    )
