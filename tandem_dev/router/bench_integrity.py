"""``tandem bench integrity``: output integrity under the GPU numerics SGLang has by default (issue #33).

SGLang without ``--enable-deterministic-inference`` is not batch-invariant: a temperature-0 answer can change with
the batch around it where two tokens are nearly tied. The simulator models that by default (simulator/README.md,
"GPU numerics"); the router's canaries, shadows, confirmations and probation judge a difference by where and how
two answers diverge (``tandem_router.integrity.divergence``). Router defaults throughout (canary round every 30 s,
1% of deterministic requests shadowed, probation after 5 s, 100 clean comparisons to release).

* **numerics**: two stacks side by side in one run, default numerics and ``--enable-deterministic-inference`` on
  every worker, each with 2 prefills and 2 clean decodes (KV offload on) under ``CLIENTS`` temperature-0 clients
  asking for long answers, for ``DURATION_S``. Target: 0 quarantines, 0 failed canaries, 0 shadow mismatches.
* **garbling decode**: one of two decodes runs the upstream offload race (``--sim-inject-offload-race``) under
  default numerics. Target: every pair of that decode out of traffic within 10 s of the load's start, no clean
  pair ever quarantined, no garbling pair ever released.
* **probation**: a decode garbles (the race switched on at runtime) until its pairs are quarantined, then stops
  (switched off). Target: probation releases its pairs under default numerics.
"""

from __future__ import annotations

import asyncio
import random
import tempfile
import time
from collections.abc import Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import aiohttp

from tandem_dev.bench import BenchArgs, Plot, Table
from tandem_dev.procs import ManagedProcess
from tandem_dev.router.integrity_stack import IntegrityStack, integrity_state, metric_values, start_integrity_stack

DURATION_S = 600.0
QUICK_DURATION_S = 20.0
CLIENTS = 24  # per stack: with two stacks side by side the 2-core machine is saturated
ANSWER_TOKENS = (200, 400)
BIG_POOL = ("--max-total-tokens", "16384")  # the numerics stacks: ~36 long answers per decode batch
DETERMINISTIC = "--enable-deterministic-inference"
OUT_WITHIN_S = 10.0
RELEASE_WITHIN_S = 300.0
AFTER_OUT_S = 60.0
NUMERICS_PLOTTED = ("canaries numerical", "canaries failed", "shadows numerical", "shadow mismatches", "quarantines")


def bodies(n: int, seed: int, tokens: tuple[int, int]) -> list[dict[str, Any]]:
    """``n`` temperature-0 /generate bodies: prompts of 20-80 made-up words, answers of ``tokens`` tokens."""
    rng = random.Random(seed)
    syllables = [c + v for c in "bdfgklmnprstvz" for v in "aeiou"]
    out = []
    for _ in range(n):
        words = ["".join(rng.choice(syllables) for _ in range(rng.randint(2, 4))) for _ in range(rng.randint(20, 80))]
        params = {"max_new_tokens": rng.randint(*tokens), "temperature": 0.0, "ignore_eos": True}
        out.append({"text": " ".join(words), "sampling_params": params})
    return out


@dataclass
class Load:
    ok: int = 0
    errors: int = 0
    tokens: int = 0
    seconds: float = 0.0


async def run_load(
    sess: aiohttp.ClientSession, url: str, work: list[dict[str, Any]], clients: int, stop: asyncio.Event
) -> Load:
    """``clients`` closed-loop clients cycling through ``work`` until ``stop``."""
    load, started = Load(), time.monotonic()
    cursor = iter(range(1 << 62))

    async def client() -> None:
        while not stop.is_set():
            body = work[next(cursor) % len(work)]
            try:
                async with sess.post(f"{url}/generate", json=body) as resp:
                    doc = await resp.json()
                    if resp.status == 200:
                        load.ok += 1
                        load.tokens += int(doc.get("meta_info", {}).get("completion_tokens", 0))
                    else:
                        load.errors += 1
            except aiohttp.ClientError:
                load.errors += 1

    await asyncio.gather(*(client() for _ in range(clients)))
    load.seconds = time.monotonic() - started
    return load


async def _counts(sess: aiohttp.ClientSession, url: str, name: str) -> dict[str, float]:
    """``{result label value: count}`` of a counter labelled ``result`` (``""`` key for an unlabelled one)."""
    values = await metric_values(sess, url, f"{name}_total")
    return {labels.partition('="')[2].rstrip('"'): v for labels, v in values.items()}


async def _numerics(stacks: dict[str, IntegrityStack], seconds: float) -> list[Sequence[object]]:
    work = bodies(400, seed=33, tokens=ANSWER_TOKENS)
    stop = asyncio.Event()
    async with aiohttp.ClientSession(connector=aiohttp.TCPConnector(limit=0)) as sess:
        loads = [asyncio.create_task(run_load(sess, s.router_url, work, CLIENTS, stop)) for s in stacks.values()]
        await asyncio.sleep(seconds)
        stop.set()
        done = await asyncio.gather(*loads)
        rows: list[Sequence[object]] = []
        for (mode, stack), load in zip(stacks.items(), done, strict=True):
            url = stack.router_url
            canaries = await _counts(sess, url, "tandem_integrity_canaries")
            shadows = await _counts(sess, url, "tandem_integrity_shadows")
            quarantines = sum((await _counts(sess, url, "tandem_integrity_quarantines")).values())
            detections = sum((await _counts(sess, url, "tandem_integrity_detections")).values())
            rows.append([
                mode, load.ok, load.errors, load.tokens / max(load.seconds, 1e-9),
                canaries.get("pass", 0), canaries.get("numerical", 0), canaries.get("fail", 0),
                shadows.get("match", 0), shadows.get("numerical", 0), shadows.get("mismatch", 0),
                detections, quarantines,
            ])  # fmt: skip
    return rows


@dataclass
class Watch:
    """What ``/integrity`` showed over a run, polled every 0.1 s."""

    first_out: float | None = None  # every pair of ``bad`` quarantined
    clean_quarantined: set[str] = field(default_factory=set)
    bad_released: int = 0
    released_at: float | None = None


async def _watch(sess: aiohttp.ClientSession, stack: IntegrityStack, bad: str, t0: float, until: float) -> Watch:
    seen, was_out = Watch(), False
    pairs = {(p.url, bad) for p in stack.prefills}
    while time.monotonic() < until:
        doc = await integrity_state(sess, stack.router_url)
        quarantined = {(q["prefill"], q["decode"]) for q in doc["quarantined"]}  # type: ignore[attr-defined]
        seen.clean_quarantined |= {d for _, d in quarantined if d != bad}
        out = pairs <= quarantined
        if out and seen.first_out is None:
            seen.first_out = time.monotonic() - t0
        if was_out and not pairs & quarantined:
            seen.bad_released += 1
            seen.released_at = time.monotonic() - t0
            return seen
        was_out = was_out or out
        await asyncio.sleep(0.1)
    return seen


async def _set_race(sess: aiohttp.ClientSession, decode_url: str, on: bool) -> None:
    async with sess.post(f"{decode_url}/tandem/sim/faults", json={"offload_race": on}) as resp:
        if resp.status != 200:
            raise RuntimeError(f"{decode_url} refused the offload race switch: HTTP {resp.status} {await resp.text()}")


async def _garbling(stack: IntegrityStack, quick: bool) -> tuple[Sequence[object], Load]:
    """The race on for the whole run: when its pairs are out, whether a clean one ever was, and whether a garbling
    one ever came back within ``AFTER_OUT_S`` more of load."""
    bad = stack.decodes[1].url
    work = bodies(1500, seed=11, tokens=(8, 40))
    stop = asyncio.Event()
    async with aiohttp.ClientSession(connector=aiohttp.TCPConnector(limit=0)) as sess:
        t0 = time.monotonic()
        load = asyncio.create_task(run_load(sess, stack.router_url, work, 48, stop))
        seen = await _watch(sess, stack, bad, t0, t0 + 60.0)
        if seen.first_out is not None:
            more = await _watch(sess, stack, bad, time.monotonic(), time.monotonic() + (10 if quick else AFTER_OUT_S))
            seen.clean_quarantined |= more.clean_quarantined
            seen.bad_released += more.bad_released
        stop.set()
        done = await load
        comparisons = await _counts(sess, stack.router_url, "tandem_integrity_probation_comparisons")
    row = ["garbling decode (race on throughout)", seen.first_out, len(seen.clean_quarantined), seen.bad_released,
           comparisons.get("mismatch", 0), "-"]  # fmt: skip
    return row, done


async def _probation(stack: IntegrityStack) -> tuple[Sequence[object], Load]:
    """The race on until the decode's pairs are out, then off: how long until probation releases them."""
    bad = stack.decodes[1].url
    work = bodies(1500, seed=12, tokens=(8, 40))
    stop = asyncio.Event()
    async with aiohttp.ClientSession(connector=aiohttp.TCPConnector(limit=0)) as sess:
        await _set_race(sess, bad, True)
        t0 = time.monotonic()
        load = asyncio.create_task(run_load(sess, stack.router_url, work, 48, stop))
        seen = Watch()
        while time.monotonic() - t0 < 60.0 and seen.first_out is None:
            doc = await integrity_state(sess, stack.router_url)
            if bad in doc["quarantined_workers"]:  # type: ignore[operator]
                seen.first_out = time.monotonic() - t0
            await asyncio.sleep(0.1)
        await _set_race(sess, bad, False)
        cleaned = time.monotonic()
        after = await _watch(sess, stack, bad, cleaned, cleaned + RELEASE_WITHIN_S) if seen.first_out else Watch()
        stop.set()
        done = await load
        comparisons = await _counts(sess, stack.router_url, "tandem_integrity_probation_comparisons")
    released = after.released_at if after.bad_released else None
    row = ["decode garbles, then stops (race switched off)", seen.first_out, len(after.clean_quarantined),
           after.bad_released, comparisons.get("mismatch", 0), released]  # fmt: skip
    return row, done


def run(args: BenchArgs) -> list[Table]:
    seconds = QUICK_DURATION_S if args.quick else DURATION_S
    with tempfile.TemporaryDirectory(prefix="tandem-bench-integrity-") as tmp:
        work = Path(tmp)
        procs: list[ManagedProcess] = []
        try:
            stacks = {
                mode: start_integrity_stack(
                    work / ("deterministic" if DETERMINISTIC in flags else "default"),
                    procs,
                    [False, False],
                    ["--log-level", "warning"],
                    flags,
                    reference=False,
                )
                for mode, flags in (
                    ("default (batch-variant)", [*BIG_POOL]),
                    ("--enable-deterministic-inference", [*BIG_POOL, DETERMINISTIC]),
                )
            }
            numerics = asyncio.run(_numerics(stacks, seconds))
        finally:
            for proc in reversed(procs):
                proc.stop()
        garbling_rows = []
        for name, race in (("garbling", [False, True]), ("probation", [False, False])):
            procs = []
            try:
                stack = start_integrity_stack(work / name, procs, race, ["--log-level", "warning"], reference=False)
                row, _ = asyncio.run(_garbling(stack, args.quick) if name == "garbling" else _probation(stack))
                garbling_rows.append(row)
            finally:
                for proc in reversed(procs):
                    proc.stop()
    return [
        Table(
            f"integrity under GPU numerics: 2 prefills x 2 clean decodes per mode, {CLIENTS} temperature-0 clients "
            f"each, answers of {ANSWER_TOKENS[0]}-{ANSWER_TOKENS[1]} tokens, {seconds:.0f} s side by side, router "
            "defaults",
            [
                "mode",
                "requests",
                "errors",
                "tokens/s",
                "canaries pass",
                "canaries numerical",
                "canaries failed",
                "shadows match",
                "shadows numerical",
                "shadow mismatches",
                "detector findings",
                "quarantines",
            ],
            rows=numerics,
            notes=[
                "target: 0 failed canaries, 0 shadow mismatches, 0 quarantines in both modes; 'numerical' counts "
                "answers that diverged at a near-tie (judged by logprobs), which are not failures",
                "decode workers: --max-total-tokens 16384, 16-token pages, KV offload to a file store; tokens/s of "
                "the two modes share one 2-core machine (deterministic steps cost 34.35% more, SGLang's figure)",
            ],
            plot=Plot("bar", "mode", NUMERICS_PLOTTED, "count"),
        ),
        Table(
            "a garbling decode under default numerics: 2 prefills x 2 decodes (2048-token pools, 16-token pages, "
            "KV offload), 48 temperature-0 clients, router defaults",
            [
                "scenario",
                "decode out after s",
                "clean decodes ever quarantined",
                "its pairs released",
                "probation mismatches",
                "released after the race stopped, s",
            ],
            rows=garbling_rows,
            notes=[
                f"targets: out within {OUT_WITHIN_S:g} s of the load's start (an upper bound on from the first garbled "
                f"answer), 0 clean decodes quarantined, a garbling decode's pairs never released (watched "
                f"{AFTER_OUT_S:g} s more), a decode that stopped garbling released within {RELEASE_WITHIN_S:g} s",
            ],
        ),
    ]
