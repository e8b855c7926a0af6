"""Output integrity end to end: the router detects a garbling decode, quarantines its pairs, keeps serving.

Real processes on loopback (inside the suite's loopback-only netns): simulated prefill and decode workers moving
KV with Mooncake, one decode running ``--sim-inject-offload-race`` (the upstream decode KV-offload slot-reuse
races), an aggregated worker as the ground truth, and ``tandem router`` with its integrity checks on.
"""

from __future__ import annotations

import asyncio
import sys
import time
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import aiohttp
import orjson
import pytest

from tandem.procs import ManagedProcess, free_port
from tandem_sim.testing import SimWorker, start_decode, start_prefill, start_worker
from tests.simhelpers import bounded, metric_sum, prompts

# A small decode pool (pages reused constantly) with 16-token pages, so a reused page holds a run of another
# prompt's words long enough for the prompt-leak detector (8 words).
DECODE_POOL = ["--max-total-tokens", "2048", "--page-size", "16"]
OFFLOAD = ["--disaggregation-decode-enable-offload-kvcache", "--hicache-storage-backend", "file"]
SPEED = ["--sim-inter-token-ms", "1"]


@dataclass
class Outcome:
    body: dict[str, Any]
    started: float
    ended: float
    status: int
    text: str


@dataclass
class Stack:
    prefills: list[SimWorker]
    decodes: list[SimWorker]
    reference: SimWorker
    router_url: str


def _start_stack(
    tmp_path: Path, procs: list[ManagedProcess], race: Sequence[bool], router_flags: Sequence[str]
) -> Stack:
    # SGLang's decode refuses (and its scheduler dies on) a prefill with another --page-size
    prefills = [start_prefill(f"prefill{i}", tmp_path, [*SPEED, *DECODE_POOL[2:]]) for i in range(2)]
    decodes = [
        start_decode(f"decode{i}", tmp_path, [*DECODE_POOL, *OFFLOAD, *SPEED] + (["--sim-inject-offload-race"] * r))
        for i, r in enumerate(race)
    ]
    reference = start_worker("aggregated", tmp_path, SPEED)
    procs += [w.proc for w in (*prefills, *decodes, reference)]
    port = free_port()
    argv = [sys.executable, "-m", "tandem.cli", "router", "--port", str(port), "--policy", "round_robin"]
    for p in prefills:
        argv += ["--prefill", p.url, str(p.bootstrap_port)]
    for d in decodes:
        argv += ["--decode", d.url]
    router = ManagedProcess("router", [*argv, *router_flags], tmp_path / "router.log").start()
    procs.append(router)
    router.wait_http(f"http://127.0.0.1:{port}/readiness", timeout=30)
    return Stack(prefills, decodes, reference, f"http://127.0.0.1:{port}")


async def _generate(sess: aiohttp.ClientSession, url: str, body: dict[str, Any], stream: bool) -> tuple[int, str]:
    async with sess.post(f"{url}/generate", json={**body, "stream": stream}) as resp:
        if not stream:
            doc = await resp.json()
            return resp.status, doc.get("text", "") if resp.status == 200 else str(doc)
        text = ""
        async for line in resp.content:
            if line.startswith(b"data: {"):
                event = orjson.loads(line[6:])
                text = event.get("text", text)  # /generate streams carry the cumulative text
        return resp.status, text


async def _load(
    sess: aiohttp.ClientSession, url: str, bodies: list[dict[str, Any]], concurrency: int, until: asyncio.Event
) -> list[Outcome]:
    """``concurrency`` clients cycling through ``bodies`` until ``until`` is set or every body was sent once."""
    queue = list(enumerate(bodies))
    out: list[Outcome] = []

    async def client() -> None:
        while queue and not until.is_set():
            i, body = queue.pop()
            started = time.monotonic()
            status, text = await _generate(sess, url, body, stream=i % 2 == 0)
            out.append(Outcome(body, started, time.monotonic(), status, text))

    await asyncio.gather(*(client() for _ in range(concurrency)))
    return out


async def _references(sess: aiohttp.ClientSession, reference: SimWorker, bodies: list[dict[str, Any]]) -> list[str]:
    async def one(body: dict[str, Any]) -> str:
        return (await _generate(sess, reference.url, body, stream=False))[1]

    return list(await bounded(32, [one(b) for b in bodies]))


async def _integrity(sess: aiohttp.ClientSession, url: str) -> dict[str, Any]:
    async with sess.get(f"{url}/integrity") as resp:
        doc: dict[str, Any] = await resp.json()
        return doc


@pytest.mark.netns
@pytest.mark.timeout(240)
async def test_garbling_decode_is_quarantined_within_10s_and_clean_pairs_keep_serving(
    tmp_path: Path, proc_factory: list[ManagedProcess]
) -> None:
    stack = _start_stack(
        tmp_path,
        proc_factory,
        race=[False, True],
        router_flags=["--quarantine-probe-initial-s", "600", "--canary-interval-s", "3"],
    )
    bad = stack.decodes[1].url
    bodies = prompts(3000, seed=11)
    done = asyncio.Event()
    quarantined_at: float | None = None
    async with aiohttp.ClientSession(connector=aiohttp.TCPConnector(limit=0)) as sess:

        async def watch() -> None:
            nonlocal quarantined_at
            deadline = time.monotonic() + 90
            while time.monotonic() < deadline:
                doc = await _integrity(sess, stack.router_url)
                if quarantined_at is None and bad in doc["quarantined_workers"]:
                    quarantined_at = time.monotonic()
                    await asyncio.sleep(8)  # keep the load on for a while after the quarantine
                    break
                await asyncio.sleep(0.1)
            done.set()

        watcher = asyncio.create_task(watch())
        results = await _load(sess, stack.router_url, bodies, concurrency=48, until=done)
        await watcher
        wanted = await _references(sess, stack.reference, [r.body for r in results])
        doc = await _integrity(sess, stack.router_url)
        quarantines = await metric_sum(stack.router_url, "tandem_integrity_quarantines_total")

    assert all(r.status == 200 for r in results), [r.text for r in results if r.status != 200][:3]
    garbled = [r for r, want in zip(results, wanted, strict=True) if r.text != want]
    assert garbled, "the injected offload race produced no garbled output"
    assert quarantined_at is not None, f"the garbling decode was never quarantined: {doc}"
    first_garbled = min(r.ended for r in garbled)
    print(f"\nfirst garbled response -> decode quarantined: {quarantined_at - first_garbled:.2f} s; "
          f"{len(garbled)} garbled of {len(results)} responses before the quarantine")  # fmt: skip
    assert quarantined_at - first_garbled <= 10.0
    # Only the garbling decode's pairs are quarantined; the clean pairs keep serving, and nothing sent after the
    # quarantine comes back garbled.
    assert {q["decode"] for q in doc["quarantined"]} == {bad}
    assert doc["quarantined_workers"] == [bad]
    assert quarantines >= 2
    after = [(r, want) for r, want in zip(results, wanted, strict=True) if r.started > quarantined_at]
    assert len(after) >= 50, f"only {len(after)} requests after the quarantine"
    assert [r.text for r, want in after if r.text != want] == []


@pytest.mark.netns
@pytest.mark.timeout(600)
async def test_clean_run_of_10000_requests_has_no_false_positive(
    tmp_path: Path, proc_factory: list[ManagedProcess]
) -> None:
    stack = _start_stack(tmp_path, proc_factory, race=[False, False], router_flags=["--canary-interval-s", "2"])
    # Short outputs keep 10,000 requests to about a minute on 2 cores; the prompts still cycle the small decode pool
    # (and its offload) many times over. Each of the 500 distinct bodies is sent 20 times.
    unique = [{**b, "sampling_params": {**b["sampling_params"], "max_new_tokens": 4 + i % 9}} for i, b in
              enumerate(prompts(500, seed=23))]  # fmt: skip
    bodies = [unique[i % len(unique)] for i in range(10_000)]
    async with aiohttp.ClientSession(connector=aiohttp.TCPConnector(limit=0)) as sess:
        started = time.monotonic()
        results = await _load(sess, stack.router_url, bodies, concurrency=64, until=asyncio.Event())
        elapsed = time.monotonic() - started
        print(f"\nclean run: {len(results)} requests in {elapsed:.1f} s ({len(results) / elapsed:.0f} req/s)")
        wanted = dict(
            zip((orjson.dumps(b) for b in unique), await _references(sess, stack.reference, unique), strict=True)
        )
        doc = await _integrity(sess, stack.router_url)
        detections = await metric_sum(stack.router_url, "tandem_integrity_detections_total")
        checked = await metric_sum(stack.router_url, "tandem_integrity_checked_responses_total")
        canaries = await metric_sum(stack.router_url, "tandem_integrity_canaries_total")
    assert len(results) == 10_000
    assert all(r.status == 200 for r in results)
    garbled = [r for r in results if r.text != wanted[orjson.dumps(r.body)]]
    assert garbled == [], f"{len(garbled)} garbled outputs in a clean run"
    assert detections == 0, doc
    assert doc["quarantined"] == []
    assert checked >= 10_000
    assert canaries > 0


@pytest.mark.netns
@pytest.mark.timeout(240)
async def test_shadow_comparison_finds_the_garbling_decode(tmp_path: Path, proc_factory: list[ManagedProcess]) -> None:
    # Only the shadow comparison can see the garbling here: no canary round runs, and the prompt-leak detector
    # would need 64 words of another prompt.
    flags = ["--shadow-rate", "1", "--leak-ngram-words", "64", "--canary-interval-s", "3600"]
    stack = _start_stack(
        tmp_path, proc_factory, race=[False, True], router_flags=[*flags, "--quarantine-probe-initial-s", "600"]
    )
    bad = stack.decodes[1].url
    bodies = [{**b, "sampling_params": {**b["sampling_params"], "temperature": 0.0}} for b in prompts(3000, seed=5)]
    done = asyncio.Event()
    async with aiohttp.ClientSession(connector=aiohttp.TCPConnector(limit=0)) as sess:

        async def watch() -> None:
            deadline = time.monotonic() + 60
            while time.monotonic() < deadline and not done.is_set():
                doc = await _integrity(sess, stack.router_url)
                if bad in doc["quarantined_workers"]:
                    break
                await asyncio.sleep(0.2)
            done.set()

        watcher = asyncio.create_task(watch())
        await _load(sess, stack.router_url, bodies, concurrency=32, until=done)
        await watcher
        doc = await _integrity(sess, stack.router_url)
    assert await metric_sum(stack.router_url, "tandem_integrity_shadows_total") > 0  # shadows ran
    assert doc["quarantined_workers"] == [bad], doc
    assert any("shadow" in q["reason"] for q in doc["quarantined"]), doc
