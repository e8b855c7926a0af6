"""``--sim-slow-health-s``: a worker whose scheduler stalls under load answers ``/health`` late (503 past
``SGLANG_HEALTH_CHECK_TIMEOUT``, as SGLang does), and promptly again once idle."""

from __future__ import annotations

import asyncio
import time
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
