"""SLO-driven autoscaling on the real control plane, simulated workers under streaming load.

Decode runs ``tandem sim`` with a step time that grows with its batch (``--sim-inter-token-ms=5
--sim-decode-ms-per-seq=30``: 2 streams ~65 ms per token, 8 streams ~245 ms, 4 per group ~125 ms), the ITL target
is 150 ms: few streams, so the simulated GPU time and not this machine's CPU sets the latency. A load step from 2
to 8 streams must scale decode up (and not prefill, which is not saturated) until the ITL p90 the autoscaler sees
is back under target; when the load drops back to 2 streams decode must shrink through the drain with 0 lost
streams. The test sets short windows (interval 2 s, up 8 s, down 10 s) and ``scaleDownBelow: 0.6`` to stay
within minutes. Generous bounds: the machine is shared, the assertions are about behaviour. The timeline PNG goes
to the test's log directory (its path is printed).
"""

from __future__ import annotations

import asyncio
import json
import signal
import time
from typing import Any

import pytest
from kubernetes_asyncio import client

from tandem_dev.autoscale_plot import Sample, plot_timeline
from tests.operator.live import (
    GROUP,
    SIM_MODEL,
    VERSION,
    Live,
    create_pdcluster,
    load_result,
    pdc_status,
    pdcluster,
    pods,
    run_tool,
    sim_stack,
    start_load,
)
from tests.tandem_dev.devcluster.devcluster_fixtures import eventually

pytestmark = [pytest.mark.k8s, pytest.mark.netns, pytest.mark.timeout(420)]
ONE_NODE = {"nodesPerGroup": 1, "gpusPerNode": 1, "tpSize": 1, "epSize": 1, "moeA2ABackend": "none"}
TTFT_MS, ITL_MS = 3000, 150
BASE, STEP = 2, 6  # streams: the base load, and what the step adds
TOKENS = 20


def autoscaling(router_metrics: str) -> dict[str, Any]:
    return {
        "targets": {"ttftP90Ms": TTFT_MS, "itlP90Ms": ITL_MS},
        "prefill": {"minGroups": 1, "maxGroups": 2},
        "decode": {"minGroups": 1, "maxGroups": 4},
        "routerMetrics": [router_metrics],
        "intervalSeconds": 2,
        "scaleUpStabilizationSeconds": 8,
        "scaleDownStabilizationSeconds": 10,
        "scaleDownBelow": 0.6,
    }


async def pool_replicas(api: client.ApiClient, ns: str, role: str) -> int:
    pool = await client.CustomObjectsApi(api).get_namespaced_custom_object(GROUP, VERSION, ns, "pdpools", f"sim-{role}")
    return int(pool["spec"]["replicas"])


async def test_invalid_autoscaling_is_refused_with_field_paths(live: Live) -> None:
    body = pdcluster("bad", simulated=True)
    body["spec"]["autoscaling"] = {
        **autoscaling("http://127.0.0.1:1/metrics"),
        "decode": {"minGroups": 3, "maxGroups": 2},
    }
    with pytest.raises(client.ApiException) as refused:
        await create_pdcluster(live.api, live.ns, body)
    assert "spec.autoscaling.decode.minGroups" in str(refused.value.body)
    assert "minGroups must be less than or equal to maxGroups" in str(refused.value.body)


async def test_load_step_scales_decode_up_then_down_without_losing_a_stream(live: Live) -> None:
    ns, api = live.ns, live.api
    decode = {**ONE_NODE, "groups": 1, "extraArgs": ["--sim-inter-token-ms=5", "--sim-decode-ms-per-seq=30"]}
    async with sim_stack(live, ["decode-0", "prefill-0"], decode=decode) as sim:
        patch = json.dumps({"spec": {"autoscaling": autoscaling(sim.metrics_url)}})
        await run_tool(live.cluster, "kubectl", "-n", ns, "patch", "pdcluster/sim", "--type", "merge", "-p", patch)
        samples: list[Sample] = []
        streams = BASE
        start = time.monotonic()

        async def record() -> None:
            while True:
                seen = (await pdc_status(api, ns, "sim")).get("autoscaling") or {}
                prefill, decode_n = await pool_replicas(api, ns, "prefill"), await pool_replicas(api, ns, "decode")
                t = time.monotonic() - start
                samples.append(Sample(t, streams, prefill, decode_n, seen.get("ttftP90Ms"), seen.get("itlP90Ms")))
                await asyncio.sleep(1.0)

        recorder = asyncio.create_task(record())
        base = await start_load(sim.base_url, SIM_MODEL, BASE, 600, TOKENS)
        try:
            await asyncio.sleep(15)  # the base load alone (within target on one group unless the machine crawls)
            before = await pool_replicas(api, ns, "decode")
            step = await start_load(sim.base_url, SIM_MODEL, STEP, 600, TOKENS)
            streams, stepped = BASE + STEP, time.monotonic()

            async def decode_grew() -> bool:
                return await pool_replicas(api, ns, "decode") > before

            await eventually(decode_grew, "decode scaled up after the load step", within=90)
            scaled_up_s = time.monotonic() - stepped
            assert await pool_replicas(api, ns, "prefill") == 1, "prefill is not saturated: it must not grow"

            async def slo_met() -> bool:
                seen = (await pdc_status(api, ns, "sim")).get("autoscaling") or {}
                itl = seen.get("itlP90Ms")
                return itl is not None and 0 < itl <= ITL_MS

            await eventually(slo_met, "the ITL p90 back under target", within=120)
            slo_s = time.monotonic() - stepped
            step.send_signal(signal.SIGTERM)
            step_result = await load_result(step, within=60)
            streams, dropped = BASE, time.monotonic()

            peak = max(s.decode for s in samples)

            async def decode_shrank() -> bool:
                return await pool_replicas(api, ns, "decode") < peak

            await eventually(decode_shrank, f"decode scaled down from {peak} groups after the load dropped", within=120)

            async def drained() -> bool:
                groups = await pool_replicas(api, ns, "decode")
                return len([p for p in await pods(api, ns) if p.metadata.name.startswith("sim-decode-")]) == groups

            await eventually(drained, "the retired decode groups' pods deleted after their drain", within=120)
            scaled_down_s = time.monotonic() - dropped
            await asyncio.sleep(3)
        finally:
            base.send_signal(signal.SIGTERM)
            recorder.cancel()
            path = live.tmp / "autoscale-timeline.png"
            plot_timeline(samples, TTFT_MS, ITL_MS, path)
            print(f"\ntimeline {path}:\n" + "\n".join(map(str, samples[::3])))
        base_result = await load_result(base, within=60)
        status = (await pdc_status(api, ns, "sim")).get("autoscaling") or {}
    print(
        f"\nautoscale: decode scaled up {scaled_up_s:.1f} s after the step, ITL p90 under target after {slo_s:.1f} s;"
        f" scaled down and drained {scaled_down_s:.1f} s after the drop; last decision {status}\n"
        f"base load {base_result['ok']} ok, {base_result['cut_mid_stream']} cut, "
        f"{len(base_result['failed_before_first_byte'])} failed; step load {step_result['ok']} ok, "
        f"{step_result['cut_mid_stream']} cut, {len(step_result['failed_before_first_byte'])} failed"
    )
    for result in (base_result, step_result):
        assert result["cut_mid_stream"] == 0
        assert result["failed_before_first_byte"] == []
    assert max(s.decode for s in samples) >= 2
    assert max(s.prefill for s in samples) == 1
