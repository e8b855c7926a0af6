"""The simulated worker under load over HTTP: the radix cache as SGLang reports it (``meta_info.cached_tokens``,
``sglang:cached_tokens_total``, ``sglang:cache_hit_rate``), queueing at ``--max-running-requests``, and the
property that batching and caching change timing only: a prompt at temperature 0 gives the same text whatever
the concurrency and the cache state."""

from __future__ import annotations

import asyncio
import random
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import aiohttp
import pytest

from tandem_dev.sim.testing import SimWorker, pd_fields, start_decode, start_prefill, start_worker
from tandem_sim.model import model
from tests.plumbing.simhelpers import REAL_WORDS, bounded, metric_sum, prompts

pytestmark = pytest.mark.procs

# Tight batching knobs so that a few dozen requests queue, share decode steps and get chunked prefills.
# These tests compare texts across batches and cache states: batch-invariant kernels, as a user wanting that runs
# SGLang (default numerics: tests/sim/test_numerics_server.py).
DETERMINISTIC = "--enable-deterministic-inference"
LOADED = ["--enable-metrics", "--page-size", "4", "--max-running-requests", "4", DETERMINISTIC]
LOADED += ["--max-prefill-tokens", "64", "--chunked-prefill-size", "16"]


@pytest.fixture(scope="module")
def loaded(tmp_path_factory: pytest.TempPathFactory) -> Iterator[SimWorker]:
    w = start_worker("loaded", tmp_path_factory.mktemp("sim-load"), LOADED)
    yield w
    w.proc.stop()


async def _generate(sess: aiohttp.ClientSession, url: str, body: dict[str, Any]) -> dict[str, Any]:
    async with sess.post(f"{url}/generate", json=body) as resp:
        assert resp.status == 200, await resp.text()
        doc: dict[str, Any] = await resp.json()
        return doc


async def _state(sess: aiohttp.ClientSession, url: str) -> dict[str, Any]:
    async with sess.get(f"{url}/server_info") as resp:
        doc: dict[str, Any] = await resp.json()
        return doc


def _greedy(words: int, seed: int, max_new: int = 24) -> dict[str, Any]:
    rng = random.Random(seed)
    text = " ".join(rng.choice(REAL_WORDS) for _ in range(words))
    return {"text": text, "sampling_params": {"max_new_tokens": max_new, "temperature": 0.0}}


async def test_second_request_hits_the_radix_cache(loaded: SimWorker) -> None:
    body = _greedy(41, seed=7)
    async with aiohttp.ClientSession() as sess:
        cached_before = await metric_sum(loaded.url, "sglang:cached_tokens_total")
        prompt_before = await metric_sum(loaded.url, "sglang:prompt_tokens_total")
        first = await _generate(sess, loaded.url, body)
        second = await _generate(sess, loaded.url, body)
    n = len(model.tokenize(body["text"]).ids)
    assert first["meta_info"]["cached_tokens"] == 0
    assert second["meta_info"]["cached_tokens"] == (n - 1) // 4 * 4  # whole pages, never the last token
    assert second["text"] == first["text"]
    assert await metric_sum(loaded.url, "sglang:cache_hit_rate") == pytest.approx((n - 1) // 4 * 4 / n)
    async with aiohttp.ClientSession() as sess:
        async with sess.post(f"{loaded.url}/flush_cache") as resp:
            assert resp.status == 200
        assert (await _generate(sess, loaded.url, body))["meta_info"]["cached_tokens"] == 0
    assert await metric_sum(loaded.url, "sglang:cached_tokens_total") - cached_before == (n - 1) // 4 * 4
    assert await metric_sum(loaded.url, "sglang:prompt_tokens_total") - prompt_before == 3 * n


async def test_same_text_whatever_the_concurrency_and_cache_state(tmp_path: Path, loaded: SimWorker) -> None:
    """Reference texts from a worker with no radix cache, one request at a time; then the same prompts on a
    loaded worker with a warm cache, 48 at once behind ``--max-running-requests 4`` with chunked prefill, mixed
    with other traffic, and again on a worker whose cache is too small to keep anything (LRU eviction)."""
    targets = [_greedy(words, seed) for seed, words in enumerate((5, 23, 40, 77))]
    noise = [dict(b, sampling_params={**b["sampling_params"], "temperature": 0.0}) for b in prompts(24, seed=3)]
    cold = start_worker("cold", tmp_path, ["--disable-radix-cache", DETERMINISTIC])
    tiny = start_worker("tiny", tmp_path, ["--max-total-tokens", "256", "--page-size", "4", DETERMINISTIC])
    try:
        async with aiohttp.ClientSession() as sess:
            reference = [(await _generate(sess, cold.url, body))["text"] for body in targets]
            assert all(reference)
            for body in targets:  # warm the loaded worker's cache with the very prompts
                await _generate(sess, loaded.url, body)
            mixed = targets * 6 + noise
            random.Random(0).shuffle(mixed)
            for url in (loaded.url, tiny.url):
                outs = await bounded(48, [_generate(sess, url, body) for body in mixed])
                for body, out in zip(mixed, outs, strict=True):
                    if body in targets:
                        assert out["text"] == reference[targets.index(body)]
            state = (await _state(sess, loaded.url))["internal_states"][0]
        assert state["max_decode_batch"] > 1  # requests really shared decode steps
        assert state["prefill_chunks"] > 0  # and long prompts were chunked
        assert state["max_decode_batch"] <= 4  # --max-running-requests queued the rest
    finally:
        cold.proc.stop()
        tiny.proc.stop()


async def test_requests_queue_behind_max_running_requests(loaded: SimWorker) -> None:
    slow = [_greedy(8, seed, max_new=60) for seed in range(100, 112)]
    async with aiohttp.ClientSession() as sess:
        jobs = asyncio.gather(*(_generate(sess, loaded.url, body) for body in slow))
        seen_running, seen_queued = 0.0, 0.0
        for _ in range(200):
            await asyncio.sleep(0.01)
            seen_running = max(seen_running, await metric_sum(loaded.url, "sglang:num_running_reqs"))
            seen_queued = max(seen_queued, await metric_sum(loaded.url, "sglang:num_queue_reqs"))
            if jobs.done():
                break
        await jobs
    assert seen_running <= 4
    assert seen_queued > 0


@pytest.mark.netns
async def test_pd_prefill_reports_cache_hits_and_decode_text_is_unchanged(tmp_path: Path, loaded: SimWorker) -> None:
    """A PD pair: the prefill's radix cache serves the second request (``meta_info.cached_tokens`` on the prefill's
    answer, as SGLang's prefill reports it); the decode's text is the aggregated worker's, hit or not."""
    prefill = start_prefill("pd-prefill", tmp_path, ["--page-size", "4", DETERMINISTIC])
    decode = start_decode("pd-decode", tmp_path, ["--page-size", "4", DETERMINISTIC])
    body = _greedy(30, seed=11)
    n = len(model.tokenize(body["text"]).ids)
    try:
        async with aiohttp.ClientSession() as sess:
            reference = (await _generate(sess, loaded.url, body))["text"]
            for room, cached in ((1, 0), (2, (n - 1) // 4 * 4)):
                full = dict(body, **pd_fields(prefill, room))
                p, d = await asyncio.gather(_generate(sess, prefill.url, full), _generate(sess, decode.url, full))
                assert p["meta_info"]["cached_tokens"] == cached
                assert d["text"] == reference
    finally:
        prefill.proc.stop()
        decode.proc.stop()
