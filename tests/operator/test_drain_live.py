"""Drain on the real control plane: ``kubectl scale pdpool/sim-decode`` down under streaming load, and the streams
on the retired decode finish there.

The pod runner runs ``tandem sim`` behind each pod IP (decode at 20 ms per token, so a 100-token stream lasts
~2 s); the operator unregisters the retired decode group, waits for its leader's ``sglang:num_running_reqs`` and
transfer gauges to reach 0, then deletes its pods.

What tells a drain from a kill is the router's counters, not the clients: a killed decode's streams are resumed on
the other decode, so the clients would see every stream end OK either way. So the test scales down only once the
router shows streams in flight on decode-1, keeps the load running until decode-1's pods are gone (the load ends
on SIGTERM, not on a clock a busy machine could outrun), and then requires that no attempt involving decode-1
failed, no stream was resumed or refused a resume, and no client stream was cut or failed.
"""

from __future__ import annotations

import signal
import time

import pytest

from tests.operator.live import SIM_MODEL, Live, load_result, pods, run_tool, sim_stack, start_load
from tests.plumbing.routermetrics import scrape
from tests.tandem_dev.devcluster.devcluster_fixtures import eventually

pytestmark = [pytest.mark.k8s, pytest.mark.netns, pytest.mark.timeout(300)]
ONE_NODE = {"nodesPerGroup": 1, "gpusPerNode": 1, "tpSize": 1, "epSize": 1, "moeA2ABackend": "none"}
STREAMS, TOKENS = 16, 100
LOAD_S = 200.0  # an upper bound only: the test ends the load (SIGTERM) once the drained decode's pods are gone


async def test_scale_down_under_streaming_load_drains_the_decode(live: Live) -> None:
    ns = live.ns
    decode = {**ONE_NODE, "groups": 2, "extraArgs": ["--sim-inter-token-ms=20"]}
    groups = ["decode-0", "decode-1", "prefill-0"]
    async with sim_stack(live, groups, decode=decode) as sim:
        router = sim.metrics_url.removesuffix("/metrics")
        draining = (await sim.reg.endpoints(ns, "sim"))["decode-1"].url
        load = await start_load(sim.base_url, SIM_MODEL, STREAMS, LOAD_S, TOKENS)
        try:

            async def streams_on_draining() -> float | None:
                return (await scrape(router)).in_flight.get(draining) or None

            # In flight on decode-1 just before the drain, then as last seen while the router still listed it.
            seen = [await eventually(streams_on_draining, "streams in flight on decode-1", within=60)]
            scaled = time.monotonic()
            await run_tool(live.cluster, "kubectl", "-n", ns, "scale", "pdpool/sim-decode", "--replicas=1")

            async def out_of_routing() -> bool:
                in_flight = (await scrape(router)).in_flight
                if draining in in_flight:
                    seen.append(in_flight[draining])
                    return False
                return "decode-1" not in await sim.reg.endpoints(ns, "sim")

            await eventually(out_of_routing, "decode-1 unregistered and out of the router's pool", within=60)
            unregistered_s = time.monotonic() - scaled

            async def gone() -> bool:
                return not [p for p in await pods(live.api, ns) if p.metadata.name.startswith("sim-decode-1-")]

            await eventually(gone, "decode-1's pods deleted after the drain", within=120)
            deleted_s = time.monotonic() - scaled
        finally:
            if load.returncode is None:
                load.send_signal(signal.SIGTERM)
        result = await load_result(load, within=60)
        metrics = await scrape(router)
    print(
        f"\nscale-down: out of routing {unregistered_s:.2f} s, pods deleted {deleted_s:.2f} s after kubectl scale; "
        f"streams in flight on decode-1 when it left routing: {seen[-1]:g} (samples {seen}); "
        f"load {result['ok']} ok, {result['cut_mid_stream']} cut mid-stream, "
        f"{len(result['failed_before_first_byte'])} failed before a byte; router: "
        f"failed attempts {dict(metrics.failures)}, retries {dict(metrics.retries)}, "
        f"resumed {dict(metrics.resumed)}, resume refused {dict(metrics.refused)}, "
        f"stream error events {metrics.stream_errors:g}"
    )
    assert seen[-1] > 0  # the drain began with streams on decode-1 (under a steady load: it never idles)
    assert metrics.failures[draining] == 0  # no attempt on decode-1 failed: its streams finished there ...
    assert sum(metrics.resumed.values()) == 0  # ... not moved to decode-0 (a resume would hide a kill's cuts)
    assert sum(metrics.refused.values()) == 0
    assert metrics.stream_errors == 0
    assert result["cut_mid_stream"] == 0
    assert result["failed_before_first_byte"] == []
    assert result["ok"] > STREAMS
    assert deleted_s > unregistered_s
