"""``tandem bench sim-load``: the simulated worker under growing load, per ``--sim-profile``.

For each profile a closed loop of ``c`` streaming clients (``c`` = 1 .. 256) drives one server: aggregated for
``instant`` and ``cpu-small``; a PD pair (one prefill, one decode worker, KV over Mooncake) for
``kimi-k2.6-h200``, whose constants come from PD deployments. Per level: output tokens/s, TTFT and ITL p50/p99
(measured by the client on the SSE stream), and whether the throughput has stopped growing (the knee: the first
level reaching 90% of the best throughput). One table and one PNG per profile.

``kimi-k2.6-h200`` runs at ``--sim-time-factor`` ``KIMI_TIME_FACTOR`` (slower than real time, so that the 2
cores keep up); its times and rates are reported with the factor removed, next to the published numbers the
profile was built from (``profiles.KIMI_PUBLISHED``, per GPU).
"""

from __future__ import annotations

import asyncio
import random
import tempfile
import time
from collections.abc import Sequence
from contextlib import ExitStack
from dataclasses import dataclass, field
from pathlib import Path

import aiohttp
import numpy as np

from tandem_dev.bench import BenchArgs, Plot, Table
from tandem_dev.sim.testing import SimWorker, pd_fields, start_decode, start_prefill, start_worker
from tandem_sim.model.profiles import KIMI_PUBLISHED

LEVELS = (1, 2, 4, 8, 16, 32, 64, 128, 256)
QUICK_LEVELS = (1, 4, 16)
PROMPT_WORDS, SHARED_WORDS, OUTPUT_TOKENS = 256, 192, 32
KIMI_TIME_FACTOR = 4.0


@dataclass
class Level:
    concurrency: int
    elapsed: float = 0.0
    output_tokens: int = 0
    ttft: list[float] = field(default_factory=list)
    itl: list[float] = field(default_factory=list)


def _word(rng: random.Random) -> str:
    return "".join(rng.choice("bcdfghklmnprstvz") + rng.choice("aeiou") for _ in range(3))


def _shared_prefix() -> str:
    rng = random.Random(0)
    return " ".join(_word(rng) for _ in range(SHARED_WORDS))


SHARED_PREFIX = _shared_prefix()


def _prompt(rng: random.Random) -> str:
    """A shared system prompt (radix cache hits after the first request) and a distinct question."""
    return SHARED_PREFIX + " " + " ".join(_word(rng) for _ in range(PROMPT_WORDS - SHARED_WORDS))


async def _stream(
    sess: aiohttp.ClientSession, prefill: SimWorker | None, server: SimWorker, body: dict[str, object], level: Level
) -> None:
    started = time.monotonic()
    if prefill is not None:
        body = dict(body, **pd_fields(prefill, random.randrange(2**63)))
        prefill_post = asyncio.ensure_future(sess.post(f"{prefill.url}/generate", json=body))
    last, tokens = started, 0
    async with sess.post(f"{server.url}/generate", json=dict(body, stream=True)) as resp:
        async for line in resp.content:
            if not line.startswith(b"data: {"):
                continue
            now = time.monotonic()
            (level.itl if tokens else level.ttft).append(now - last)
            last, tokens = now, tokens + 1
    if prefill is not None:
        (await prefill_post).release()
    level.output_tokens += tokens


async def _level(prefill: SimWorker | None, server: SimWorker, concurrency: int, requests: int, seed: int) -> Level:
    rng = random.Random(seed)
    bodies: list[dict[str, object]] = [
        {"text": _prompt(rng), "sampling_params": {"max_new_tokens": OUTPUT_TOKENS, "ignore_eos": True}}
        for _ in range(requests)
    ]
    level = Level(concurrency)
    sem = asyncio.Semaphore(concurrency)
    async with aiohttp.ClientSession(connector=aiohttp.TCPConnector(limit=0)) as sess:

        async def one(body: dict[str, object]) -> None:
            async with sem:
                await _stream(sess, prefill, server, body, level)

        started = time.monotonic()
        await asyncio.gather(*(one(b) for b in bodies))
        level.elapsed = time.monotonic() - started
    return level


def _pct(values: list[float], q: float, scale: float) -> float:
    return float(np.percentile(values, q)) * scale if values else float("nan")


def _table(profile: str, levels: list[Level], factor: float, pd: bool) -> Table:
    rates = [lv.output_tokens / lv.elapsed * factor for lv in levels]
    best = max(rates)
    knee = next(lv.concurrency for lv, rate in zip(levels, rates, strict=True) if rate >= 0.9 * best)
    kimi = profile == "kimi-k2.6-h200"
    columns = ["concurrency", "output tok/s", "TTFT p50 s", "TTFT p99 s", "ITL p50 ms", "ITL p99 ms", "knee"]
    if kimi:
        columns += ["tok/s vs published", "ITL p50 vs published"]
    rows: list[Sequence[object]] = []
    for lv, rate in zip(levels, rates, strict=True):
        scale = 1.0 / factor
        row: list[object] = [
            lv.concurrency,
            rate,
            _pct(lv.ttft, 50, scale),
            _pct(lv.ttft, 99, scale),
            _pct(lv.itl, 50, 1000 * scale),
            _pct(lv.itl, 99, 1000 * scale),
            "<- knee" if lv.concurrency == knee else "",
        ]
        if kimi:
            row += [rate / KIMI_PUBLISHED.decode_tok_s, _pct(lv.itl, 50, 1000 * scale) / KIMI_PUBLISHED.itl_ms]
        rows.append(row)
    notes = [
        f"{'PD pair (1 prefill + 1 decode worker)' if pd else 'one aggregated worker'}, 1 DP group; closed loop of "
        f"`concurrency` streaming clients; {PROMPT_WORDS}-token prompts whose first {SHARED_WORDS} tokens are a "
        "shared system prompt (radix cache hits after the first request), "
        f"{OUTPUT_TOKENS} output tokens; knee: first level at >= 90% of the best throughput",
    ]
    if kimi:
        low, high = KIMI_PUBLISHED.ttft_s
        notes.append(
            f"run at --sim-time-factor {factor:g}; times and rates shown with the factor removed. Published (per GPU, "
            f"LMSYS 2025-05-05, 2000-token inputs, ~279 running sequences): {KIMI_PUBLISHED.decode_tok_s:,.0f} output "
            f"tok/s at ITL ~{KIMI_PUBLISHED.itl_ms:g} ms, TTFT {low:g}-{high:g} s;"
            " this workload has shorter contexts and at most 256 sequences, so it stays below that point"
        )
    return Table(
        f"sim-load: saturation, --sim-profile {profile}",
        columns,
        rows,
        notes=notes,
        plot=Plot(kind="line", x="concurrency", ys=["output tok/s"], ylabel="output tokens/s", log_y=False),
    )


def _run_profile(profile: str, levels: Sequence[int], quick: bool, log_dir: Path) -> Table:
    kimi = profile == "kimi-k2.6-h200"
    factor = KIMI_TIME_FACTOR if kimi else 1.0
    flags = ["--sim-profile", profile, "--sim-time-factor", str(factor), "--max-total-tokens", "262144"]
    with ExitStack() as stack:
        if kimi:
            prefill = start_prefill(f"load-{profile}-prefill", log_dir, flags)
            stack.callback(prefill.proc.stop)
            server = start_decode(f"load-{profile}-decode", log_dir, flags)
        else:
            prefill, server = None, start_worker(f"load-{profile}", log_dir, flags)
        stack.callback(server.proc.stop)
        asyncio.run(_level(prefill, server, 4, 4, seed=0))  # warm-up: connections, sessions
        results = []
        for n, concurrency in enumerate(levels):
            requests = concurrency if quick else max(8, 2 * concurrency)
            results.append(asyncio.run(_level(prefill, server, concurrency, requests, seed=n + 1)))
    return _table(profile, results, factor, kimi)


def run(args: BenchArgs) -> list[Table]:
    levels = QUICK_LEVELS if args.quick else LEVELS
    with tempfile.TemporaryDirectory(prefix="tandem-bench-load-") as tmp:
        return [_run_profile(p, levels, args.quick, Path(tmp)) for p in ("instant", "cpu-small", "kimi-k2.6-h200")]
