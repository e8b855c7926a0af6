"""Drain on the real control plane: ``kubectl scale pdpool/sim-decode`` down under streaming load loses 0 streams.

The pod runner runs ``tandem sim`` behind each pod IP (decode at 20 ms per token, so a 100-token stream lasts
~2 s and streams are in flight when the scale-down lands); the operator unregisters the retired decode group,
waits for its leader's ``sglang:num_running_reqs`` and transfer gauges to reach 0, then deletes its pods.
"""

from __future__ import annotations

import asyncio
import time

import pytest

from tests.operator.live import SIM_MODEL, Live, load_result, pods, run_tool, sim_stack, start_load
from tests.tandem_dev.devcluster.devcluster_fixtures import eventually

pytestmark = [pytest.mark.k8s, pytest.mark.netns, pytest.mark.timeout(300)]
ONE_NODE = {"nodesPerGroup": 1, "gpusPerNode": 1, "tpSize": 1, "epSize": 1, "moeA2ABackend": "none"}
STREAMS, SECONDS, TOKENS = 16, 14.0, 100


async def test_scale_down_under_streaming_load_loses_no_stream(
    live: Live,
) -> None:
    ns = live.ns
    decode = {**ONE_NODE, "groups": 2, "extraArgs": ["--sim-inter-token-ms=20"]}
    groups = ["decode-0", "decode-1", "prefill-0"]
    async with sim_stack(live, groups, decode=decode) as sim:
        load = await start_load(sim.base_url, SIM_MODEL, STREAMS, SECONDS, TOKENS)
        await asyncio.sleep(4.0)  # every stream slot busy, both decodes streaming
        scaled = time.monotonic()
        await run_tool(live.cluster, "kubectl", "-n", ns, "scale", "pdpool/sim-decode", "--replicas=1")

        async def unregistered() -> bool:
            return "decode-1" not in await sim.reg.endpoints(ns, "sim")

        await eventually(unregistered, "decode-1 unregistered", within=30)
        unregistered_s = time.monotonic() - scaled

        async def gone() -> bool:
            return not [p for p in await pods(live.api, ns) if p.metadata.name.startswith("sim-decode-1-")]

        await eventually(gone, "decode-1's pods deleted after the drain", within=120)
        deleted_s = time.monotonic() - scaled
        result = await load_result(load, within=SECONDS + 90)
    print(
        f"\nscale-down: unregistered {unregistered_s:.2f} s, pods deleted {deleted_s:.2f} s after kubectl scale; "
        f"load {result['ok']} ok, {result['cut_mid_stream']} cut mid-stream, "
        f"{len(result['failed_before_first_byte'])} failed before a byte"
    )
    assert result["cut_mid_stream"] == 0
    assert result["failed_before_first_byte"] == []
    assert result["ok"] > STREAMS
    assert deleted_s > unregistered_s
