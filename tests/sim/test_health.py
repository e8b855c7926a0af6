"""SGLang 0.5.23's health endpoints in ``tandem sim`` (``tandem_sim/http/health.py``): ``/health`` waits for the
scheduler's next output (503 past ``SGLANG_HEALTH_CHECK_TIMEOUT``), ``/ready`` reports the last check's verdict,
a hung scheduler (``--sim-inject-hang-after-s``) fails them while ``/metrics`` still answers, and
``--sim-slow-health-s`` delays ``/health`` under load."""

from __future__ import annotations

import asyncio
import time
from collections.abc import Awaitable, Callable
from pathlib import Path

import aiohttp
import pytest

from tandem_dev.sim.testing import start_worker

pytestmark = pytest.mark.procs


async def test_health_is_slow_only_under_load(tmp_path: Path) -> None:
    extra = ["--sim-slow-health-s", "3", "--sim-inter-token-ms", "25"]
    worker = start_worker("slow-health", tmp_path, extra, env={"SGLANG_HEALTH_CHECK_TIMEOUT": "2"})
    try:
        async with aiohttp.ClientSession() as sess:

            async def health() -> tuple[int, float]:
                start = time.monotonic()
                async with sess.get(f"{worker.url}/health") as resp:
                    return resp.status, time.monotonic() - start

            assert (await health())[0] == 200  # idle: prompt
            body = {"text": "a long story", "sampling_params": {"max_new_tokens": 400, "ignore_eos": True}}
            load = asyncio.create_task(sess.post(f"{worker.url}/generate", json=body))
            await asyncio.sleep(0.5)
            status, took = await health()
            assert status == 503  # past SGLANG_HEALTH_CHECK_TIMEOUT under load
            assert took >= 1.9
            async with await load as resp:
                assert resp.status == 200
            assert (await health())[0] == 200
    finally:
        worker.proc.stop()


async def _status(sess: aiohttp.ClientSession, url: str) -> tuple[int, float]:
    start = time.monotonic()
    async with sess.get(url) as resp:
        return resp.status, time.monotonic() - start


async def _until(check: Callable[[], Awaitable[bool]], within: float = 30.0) -> None:
    async with asyncio.timeout(within):
        while True:
            if await check():
                return
            await asyncio.sleep(0.05)


async def _prefilling(sess: aiohttp.ClientSession, url: str) -> bool:
    async with sess.get(f"{url}/server_info") as resp:
        return any(s["num_prefilling_reqs"] for s in (await resp.json())["internal_states"])


@pytest.mark.parametrize(("chunk", "health"), [("512", 200), ("-1", 503)])
async def test_a_busy_scheduler_answers_health_after_its_next_batch(tmp_path: Path, chunk: str, health: int) -> None:
    """SGLang 0.5.23 answers a health check on a busy scheduler after its next batch
    (``Scheduler.maybe_send_health_check_signal``): a 6 s prefill in 0.5 s chunks passes ``/health`` (timeout 3 s),
    the same prompt in one batch (``--chunked-prefill-size -1``) fails it, which turns ``/ready`` 503 until a check
    passes again."""
    extra = ["--sim-prefill-ms-per-token", "1", "--chunked-prefill-size", chunk, "--max-prefill-tokens", "512"]
    worker = start_worker(f"busy-{chunk}", tmp_path, extra, env={"SGLANG_HEALTH_CHECK_TIMEOUT": "3"})
    try:
        async with aiohttp.ClientSession() as sess:
            body = {"input_ids": [7] * 6000, "sampling_params": {"max_new_tokens": 1}}
            load = asyncio.ensure_future(sess.post(f"{worker.url}/generate", json=body))
            await _until(lambda: _prefilling(sess, worker.url))
            status, took = await _status(sess, f"{worker.url}/health")
            assert status == health
            assert health == 200 or took >= 2.9  # a failure takes SGLang's whole timeout
            assert (await _status(sess, f"{worker.url}/ready"))[0] == health  # the last check's verdict
            async with await load as resp:
                assert resp.status == 200
            assert (await _status(sess, f"{worker.url}/health_generate"))[0] == 200
            assert (await _status(sess, f"{worker.url}/ready"))[0] == 200
    finally:
        worker.proc.stop()


async def test_a_hung_scheduler_fails_health_keeps_serving_metrics_and_can_resume(tmp_path: Path) -> None:
    """``{"hang": true}`` on ``/tandem/sim/faults``: the schedulers stop (the request in flight stays, its gauges
    too); ``/health`` fails after ``SGLANG_HEALTH_CHECK_TIMEOUT``, then ``/ready`` too; ``/metrics`` and the cheap
    ``/health`` of ``SGLANG_ENABLE_HEALTH_ENDPOINT_GENERATION=false`` still answer. ``{"hang": false}`` lets it go
    on."""
    extra = ["--enable-metrics", "--sim-inter-token-ms", "20"]
    env = {"SGLANG_HEALTH_CHECK_TIMEOUT": "2", "SGLANG_ENABLE_HEALTH_ENDPOINT_GENERATION": "false"}
    worker = start_worker("hang", tmp_path, extra, env=env)
    try:
        async with aiohttp.ClientSession() as sess:
            body = {"text": "a long story", "sampling_params": {"max_new_tokens": 500, "ignore_eos": True}}
            load = asyncio.ensure_future(sess.post(f"{worker.url}/generate", json=body))

            async def running() -> bool:
                async with sess.get(f"{worker.url}/metrics") as resp:
                    return 'sglang:num_running_reqs{model_name="sim/model"} 1.0' in await resp.text()

            await _until(running)
            async with sess.post(f"{worker.url}/tandem/sim/faults", json={"hang": True}) as resp:
                assert resp.status == 200
            status, took = await _status(sess, f"{worker.url}/health_generate")
            assert status == 503
            assert took >= 1.9
            assert (await _status(sess, f"{worker.url}/ready"))[0] == 503
            assert (await _status(sess, f"{worker.url}/health"))[0] == 200  # no generation: process up only
            assert await running()  # the stuck request still shows
            assert not load.done()
            async with sess.post(f"{worker.url}/tandem/sim/faults", json={"hang": False}) as resp:
                assert resp.status == 200
            assert (await _status(sess, f"{worker.url}/health_generate"))[0] == 200
            assert (await _status(sess, f"{worker.url}/ready"))[0] == 200
            async with sess.post(f"{worker.url}/abort_request", json={"abort_all": True}) as resp:
                assert resp.status == 200
            load.cancel()
    finally:
        worker.proc.stop()


async def test_inject_hang_after_stops_the_scheduler(tmp_path: Path) -> None:
    """``--sim-inject-hang-after-s 0``: hung from the start; ``/ready`` answers 200 until a check fails."""
    env = {"SGLANG_HEALTH_CHECK_TIMEOUT": "2"}
    worker = start_worker("hang-flag", tmp_path, ["--sim-inject-hang-after-s", "0"], env=env, wait=False)
    try:
        async with aiohttp.ClientSession() as sess:

            async def up() -> bool:
                try:
                    return (await _status(sess, f"{worker.url}/ready"))[0] == 200
                except aiohttp.ClientConnectionError:
                    return False

            await _until(up)
            status, took = await _status(sess, f"{worker.url}/health")
            assert status == 503
            assert took >= 1.9
            assert (await _status(sess, f"{worker.url}/ready"))[0] == 503
    finally:
        worker.proc.stop()


async def test_pause_generation_makes_ready_fail_until_continue(tmp_path: Path) -> None:
    """SGLang's ``/pause_generation`` (``in_place``): ``/ready`` 503 and requests wait; ``/continue_generation``
    brings both back."""
    worker = start_worker("pause", tmp_path)
    try:
        async with aiohttp.ClientSession() as sess:
            async with sess.post(f"{worker.url}/pause_generation", json={"mode": "in_place"}) as resp:
                assert resp.status == 200
            assert (await _status(sess, f"{worker.url}/ready"))[0] == 503
            body = {"text": "hello", "sampling_params": {"max_new_tokens": 2}}
            load = asyncio.ensure_future(sess.post(f"{worker.url}/generate", json=body))
            await asyncio.sleep(0.5)
            assert not load.done()  # held while paused
            async with sess.post(f"{worker.url}/continue_generation", json={}) as resp:
                assert resp.status == 200
            async with await load as resp:
                assert resp.status == 200
            assert (await _status(sess, f"{worker.url}/ready"))[0] == 200
    finally:
        worker.proc.stop()
