"""PD output equals aggregated output under load with decode KV offload; the injected offload race garbles it.

Real processes on loopback (inside the suite's loopback-only netns): a prefill and a decode moving KV with the
Mooncake transfer engine over TCP, and an aggregated worker as the reference.
"""

from __future__ import annotations

import random
from pathlib import Path
from typing import Any

import aiohttp
import pytest

from tandem_dev.procs import ManagedProcess
from tandem_dev.sim.testing import SimWorker, start_decode, start_prefill, start_worker
from tandem_router.integrity.detectors import PromptLeakIndex, find_bad_text, find_repetition_loop
from tests.plumbing.simhelpers import REAL_WORDS, bounded, metric_sum, pd_generate, prompts

N_REQUESTS = 500
CONCURRENCY = 64
# A small decode pool: 64 concurrent requests need ~5k tokens, the pool holds 2k, so pages are reused constantly.
DECODE_POOL = ["--max-total-tokens", "2048", "--page-size", "4"]
OFFLOAD = ["--disaggregation-decode-enable-offload-kvcache", "--hicache-storage-backend", "file"]
# Outputs are compared with the aggregated worker's text: batch-invariant kernels, as a user wanting that runs SGLang.
SPEED = ["--sim-inter-token-ms", "1", "--enable-metrics", "--enable-deterministic-inference"]


def _start(tmp_path: Path, procs: list[ManagedProcess], race: bool) -> tuple[SimWorker, SimWorker, SimWorker]:
    prefill = start_prefill("prefill", tmp_path, [*SPEED, *DECODE_POOL[2:]])  # SGLang wants one --page-size
    procs.append(prefill.proc)
    extra = [*DECODE_POOL, *OFFLOAD, *SPEED] + (["--sim-inject-offload-race"] if race else [])
    decode = start_decode("decode", tmp_path, extra)
    procs.append(decode.proc)
    reference = start_worker("aggregated", tmp_path, SPEED)
    procs.append(reference.proc)
    return prefill, decode, reference


async def _run_all(prefill: SimWorker, decode: SimWorker, reference: SimWorker) -> list[tuple[Any, ...]]:
    bodies = prompts(N_REQUESTS, seed=7)
    rng = random.Random(3)
    connector = aiohttp.TCPConnector(limit=0)
    async with aiohttp.ClientSession(connector=connector) as sess:

        async def one(body: dict[str, Any]) -> tuple[Any, ...]:
            status, got, p_status = await pd_generate(sess, prefill, decode, body, rng.randrange(2**63))
            async with sess.post(f"{reference.url}/generate", json=body) as resp:
                want = await resp.json()
            return body, status, got, p_status, want

        return await bounded(CONCURRENCY, [one(b) for b in bodies])


@pytest.mark.netns
@pytest.mark.timeout(240)
async def test_pd_equals_aggregated_under_load_with_offload(tmp_path: Path, proc_factory: list[ManagedProcess]) -> None:
    prefill, decode, reference = _start(tmp_path, proc_factory, race=False)
    results = await _run_all(prefill, decode, reference)
    failures = [(s, g) for _, s, g, p, _ in results if s != 200 or p != 200]
    assert not failures, failures[:3]
    mismatches = [(b["text"], g["text"], w["text"]) for b, _, g, _, w in results if g["text"] != w["text"]]
    assert mismatches == [], f"{len(mismatches)} mismatches, e.g. {mismatches[:2]}"
    assert all(g["meta_info"]["completion_tokens"] == w["meta_info"]["completion_tokens"] for *_, g, _, w in results)
    # The pool really was reused many times over, and offload ran.
    prompt_tokens = sum(g["meta_info"]["prompt_tokens"] for _, _, g, _, _ in results)
    assert prompt_tokens > 5 * 2048
    assert await metric_sum(decode.url, "sglang:kv_transfer_total_mb_sum") == 0.0  # decode sends nothing
    moved_mb = await metric_sum(prefill.url, "sglang:kv_transfer_total_mb_sum")
    assert moved_mb == pytest.approx(prompt_tokens * 256 / 1e6, rel=1e-6)  # every prompt KV byte really moved
    assert await metric_sum(decode.url, "tandem_sim:offload_poisoned_pages_total") == 0.0
    # The router's integrity detectors see nothing in clean output.
    index = _leak_index(results)
    for i, (body, _, got, _, _) in enumerate(results):
        assert index.check(str(i), body["text"], got["text"]) is None, (body["text"], got["text"])
        assert find_repetition_loop(got["text"]) is None, got["text"]
        assert find_bad_text(got["text"]) is None, got["text"]


def _leak_index(results: list[tuple[Any, ...]]) -> PromptLeakIndex:
    index = PromptLeakIndex(max_prompts=len(results))
    for i, (body, *_) in enumerate(results):
        index.add(str(i), body["text"])
    return index


@pytest.mark.netns
@pytest.mark.timeout(240)
async def test_injected_offload_race_garbles_with_foreign_prompt_text(
    tmp_path: Path, proc_factory: list[ManagedProcess]
) -> None:
    prefill, decode, reference = _start(tmp_path, proc_factory, race=True)
    results = await _run_all(prefill, decode, reference)
    assert all(s == 200 for _, s, _, _, _ in results)
    real = set(REAL_WORDS)
    mismatched = [(i, b, g, w) for i, (b, _, g, _, w) in enumerate(results) if g["text"] != w["text"]]
    assert len(mismatched) >= 5, f"only {len(mismatched)} mismatches with the race injected"
    # A real (non-vocabulary) word in an output that is not in the request's own prompt can only have been read
    # from another request's KV: the simulator keeps each word's surface in its KV bytes.
    all_prompt_words = set().union(*(set(b["text"].split()) for b, *_ in results))
    foreign = 0
    for _, body, got, _ in mismatched:
        stray = {w for w in got["text"].split() if w in real} - set(body["text"].split())
        if stray and stray <= all_prompt_words:
            foreign += 1
    assert foreign >= len(mismatched) // 2, f"{foreign} of {len(mismatched)} mismatches carry foreign prompt words"
    # The router's detector finds 8-word runs of other prompts in garbled outputs, as upstream users saw.
    index = _leak_index(results)
    leaks = [i for i, body, got, _ in mismatched if index.check(str(i), body["text"], got["text"]) is not None]
    assert len(leaks) >= max(5, len(mismatched) // 10), f"{len(leaks)} of {len(mismatched)} garbled outputs leak"


@pytest.mark.netns
@pytest.mark.timeout(120)
async def test_the_offload_race_switches_at_runtime_on_a_decode_with_offload_only(
    tmp_path: Path, proc_factory: list[ManagedProcess]
) -> None:
    """``/tandem/sim/faults`` ``{"offload_race": bool}``: a decode that starts, then stops garbling (the bench's
    probation scenario); a prefill refuses it with a message naming what it needs."""
    prefill, decode, _ = _start(tmp_path, proc_factory, race=False)
    async with aiohttp.ClientSession() as sess:

        async def switch(url: str, on: object) -> tuple[int, dict[str, Any]]:
            async with sess.post(f"{url}/tandem/sim/faults", json={"offload_race": on}) as resp:
                return resp.status, await resp.json()

        async def racing() -> bool:
            async with sess.get(f"{decode.url}/server_info") as resp:
                return bool((await resp.json())["tandem_sim"]["inject_offload_race"])

        assert not await racing()
        assert await switch(decode.url, True) == (200, {"offload_race": True})
        assert await racing()
        assert await switch(decode.url, False) == (200, {"offload_race": False})
        assert not await racing()
        status, doc = await switch(prefill.url, True)
        assert status == 400
        assert "--disaggregation-decode-enable-offload-kvcache" in doc["error"]
        assert (await switch(decode.url, "yes"))[0] == 400
