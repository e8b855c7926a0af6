"""The resume gap under load: a decode killed while temperature-0 chat streams run through the router.

One simulated prefill and two decodes (real PD protocol, real Mooncake KV transfer) behind the router. Streams of
``TOKENS`` tokens run ``concurrency`` at a time; once every stream of the first batch got its first byte, one
decode is killed (SIGKILL). The router resumes the streams it cut on the other decode (``resume.py``). The gap a
client saw is the longest pause between two chunks of its stream; the resumed streams are the ones with the
longest pauses, as many as the router counted resumes (``tandem_router_resumed_streams_total``). The table shows
their p50/p99 next to the router's own histogram count, the streams that failed, and the ordinary longest pause
of a stream that was not resumed (the floor on a loaded machine).
"""

from __future__ import annotations

import asyncio
import signal
import sys
import time
from pathlib import Path

import aiohttp
from prometheus_client.parser import text_string_to_metric_families

from tandem.bench import BenchArgs, Table
from tandem.procs import ManagedProcess, free_port

HOST = "127.0.0.1"
MODEL = "tandem/sim-model"
TOKENS = 200
INTER_TOKEN_MS = "10"  # 2 s streams: the kill lands mid-stream


async def _stream(http: aiohttp.ClientSession, router: str, i: int, started: asyncio.Event | None) -> float:
    """One stream; returns its longest pause between chunks (s). Raises on an error event or status."""
    body = {"model": MODEL, "messages": [{"role": "user", "content": f"stream {i}: tell me a long story"}],
            "max_tokens": TOKENS, "temperature": 0, "stream": True}  # fmt: skip
    async with http.post(f"{router}/v1/chat/completions", json=body) as resp:
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


async def _resumes(http: aiohttp.ClientSession, router: str) -> tuple[int, int]:
    """(streams resumed, resume gaps observed) from the router's metrics."""
    async with http.get(f"{router}/metrics") as resp:
        text = await resp.text()
    resumed = gaps = 0.0
    for family in text_string_to_metric_families(text):
        for sample in family.samples:
            if sample.name == "tandem_router_resumed_streams_total":
                resumed += sample.value
            elif sample.name == "tandem_router_resume_gap_seconds_count":
                gaps += sample.value
    return int(resumed), int(gaps)


def _pct(values: list[float], q: float) -> float:
    s = sorted(values)
    return s[min(len(s) - 1, int(len(s) * q))] if s else float("nan")


async def _measure(router: str, victim: ManagedProcess, concurrency: int) -> list[object]:
    async with aiohttp.ClientSession(timeout=aiohttp.ClientTimeout(total=120)) as http:
        await asyncio.gather(*(_stream(http, router, -i, None) for i in range(1, 5)))  # warm up
        events = [asyncio.Event() for _ in range(concurrency)]
        tasks = [asyncio.create_task(_stream(http, router, i, events[i])) for i in range(concurrency)]
        await asyncio.wait_for(asyncio.gather(*(e.wait() for e in events)), 60)
        victim.signal(signal.SIGKILL)
        results = await asyncio.gather(*tasks, return_exceptions=True)
        gaps = sorted(r for r in results if isinstance(r, float))
        errors = len(results) - len(gaps)
        resumed, observed = await _resumes(http, router)
    cut = gaps[len(gaps) - resumed :] if resumed else []
    rest = gaps[: len(gaps) - resumed]
    return [concurrency, resumed, observed, errors, _pct(cut, 0.5) * 1000, _pct(cut, 0.99) * 1000,
            _pct(rest, 0.99) * 1000]  # fmt: skip


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
            row = runner.run(_measure(router, procs[1], concurrency))
    finally:
        for proc in reversed(procs):
            proc.stop()
    return Table(
        f"resume gap: one of 2 decodes killed under temperature-0 chat streams ({TOKENS} tokens, "
        f"{INTER_TOKEN_MS} ms/token, router defaults: --resume-max-attempts 2)",
        [
            "concurrency",
            "resumed",
            "gaps observed",
            "failed streams",
            "resume gap p50 ms",
            "resume gap p99 ms",
            "longest pause p99, not resumed, ms",
        ],
        rows=[row],
        notes=[
            "gap as the client saw it: the longest pause between two chunks of each resumed stream "
            "(re-prefill of prompt + relayed tokens included); one kill per run, so p99 is about the maximum"
        ],
    )
