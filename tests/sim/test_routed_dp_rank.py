"""The simulated worker honours ``routed_dp_rank`` as SGLang 0.5.23 does on a decode or aggregated server with
attention DP: the request runs on that DP group, out of range is a 400 naming the range."""

from __future__ import annotations

from pathlib import Path

import aiohttp
import pytest

from tandem_dev.sim.testing import start_worker

pytestmark = pytest.mark.netns


async def test_routed_dp_rank_picks_the_dp_group(tmp_path: Path) -> None:
    worker = start_worker("agg-dp", tmp_path, ["--tp-size", "2", "--dp-size", "2", "--enable-dp-attention"])
    try:
        async with aiohttp.ClientSession() as http:
            body = {"text": "one two three four five six", "sampling_params": {"max_new_tokens": 2}}

            async def cached() -> list[int]:
                async with http.get(f"{worker.url}/server_info") as resp:
                    return [s["radix_cached_tokens"] for s in (await resp.json())["internal_states"]]

            before = await cached()
            for _ in range(2):
                async with http.post(f"{worker.url}/generate", json={**body, "routed_dp_rank": 1}) as resp:
                    assert resp.status == 200, await resp.text()
            after = await cached()
            assert after[0] == before[0]
            assert after[1] > before[1]  # both went to group 1 (round robin would have used both groups)
            async with http.post(f"{worker.url}/generate", json={**body, "data_parallel_rank": 2}) as resp:
                assert resp.status == 400
                assert "routed_dp_rank=2 out of range [0, 2)" in await resp.text()
    finally:
        worker.proc.stop()
