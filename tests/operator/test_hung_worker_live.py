"""A hung worker frees its GPUs (issue #34, part 2), on the real control plane.

The decode group's scheduler stops under streaming load (``tandem sim``'s ``{"hang": true}`` fault: the requests
stay in flight and on ``/metrics``, ``/health_generate`` answers 503 after ``SGLANG_HEALTH_CHECK_TIMEOUT``). The
pod runner plays the kubelet: it runs the pod's own probes (each on its own loop), and kills a container whose
liveness probe failed as the kubelet does: the pod's real ``preStop`` hook in the pod's namespaces (its Service
URLs resolved to the leader's pod IP: the dev cluster has no DNS), then SIGTERM, SIGKILL at the end of the
probe's own ``terminationGracePeriodSeconds`` (30 s) instead of the pod's (drain timeout + 30 s). The operator
fences the group when its container exits and recreates it with the next epoch.

The decode role sets ``SGLANG_HEALTH_CHECK_TIMEOUT=3`` (the probes follow: liveness timeout 8 s, period 10 s,
one failure), so the hang is found in 3-14 s instead of 45-56 s. Not exercised here: a real kubelet and container
runtime, the GPUs' release by the device plugin (a kwok node's GPUs are freed when the pod is gone), SGLang's own
SIGTERM handling (the simulator exits at once; SGLang exits at once when its last health check failed).
"""

from __future__ import annotations

import logging
import time

import aiohttp
import pytest
from kubernetes_asyncio import client

from tests.operator.live import SIM_MODEL, Live, load_result, pods, sim_stack, start_load
from tests.tandem_dev.devcluster.devcluster_fixtures import eventually

pytestmark = [pytest.mark.k8s, pytest.mark.netns, pytest.mark.timeout(300)]
ONE_NODE = {"groups": 1, "nodesPerGroup": 1, "gpusPerNode": 1, "tpSize": 1, "epSize": 1, "moeA2ABackend": "none"}
HEALTH_TIMEOUT_S = 3
PROBE_GRACE_S = 30


def _logged(caplog: pytest.LogCaptureFixture, message: str, field: str) -> list[float]:
    return [float(getattr(r, field)) for r in caplog.records if r.getMessage() == message]


async def test_a_hung_decode_is_killed_within_the_probe_grace_and_its_group_recreated(
    live: Live, caplog: pytest.LogCaptureFixture
) -> None:
    caplog.set_level(logging.INFO, logger="tandem_dev.devcluster.podworker")
    ns = live.ns
    decode = {
        **ONE_NODE,
        "env": [{"name": "SGLANG_HEALTH_CHECK_TIMEOUT", "value": str(HEALTH_TIMEOUT_S)}],
        "extraArgs": ["--sim-inter-token-ms=50", "--enable-metrics"],  # 100 tokens: 5 s streams
    }
    async with sim_stack(live, ["decode-0", "prefill-0"], decode=decode) as sim:
        before = {g: e.epoch for g, e in (await sim.reg.endpoints(ns, "sim")).items()}
        uids = {p.metadata.name: p.metadata.uid for p in await pods(live.api, ns)}
        (launch,) = [launch for launch, _ in sim.runner.running.values() if launch.pod == f"{ns}/sim-decode-0-0"]
        url = f"http://{launch.host}:{launch.port}"
        load = await start_load(sim.base_url, SIM_MODEL, 8, 20, max_tokens=100)
        async with aiohttp.ClientSession() as session:

            async def in_flight() -> bool:
                async with session.get(f"{url}/metrics") as resp:
                    text = await resp.text()
                return any(line.startswith("sglang:num_running_reqs") and not line.endswith(" 0.0") for line in
                           text.splitlines())  # fmt: skip

            await eventually(in_flight, "requests in flight on decode-0", within=30)
            async with session.post(f"{url}/tandem/sim/faults", json={"hang": True}) as resp:
                assert resp.status == 200
        hung_at = time.monotonic()
        core = client.CoreV1Api(live.api)

        async def terminated() -> float | None:
            """Seconds since the hang once the container is terminated, or its pod already fenced (gone or new)."""
            try:
                pod = await core.read_namespaced_pod("sim-decode-0-0", ns)
            except client.ApiException as e:
                if e.status != 404:
                    raise
                return time.monotonic() - hung_at  # the operator deleted the pod before this poll saw it exit
            if pod.metadata.uid != uids["sim-decode-0-0"]:
                return time.monotonic() - hung_at  # already recreated
            statuses = pod.status.container_statuses or []
            return time.monotonic() - hung_at if statuses and statuses[0].state.terminated else None

        killed_after = await eventually(terminated, "decode-0's container killed by its liveness probe", within=90)

        async def recreated() -> float | None:
            endpoint = (await sim.reg.endpoints(ns, "sim")).get("decode-0")
            return time.monotonic() - hung_at if endpoint and endpoint.epoch > before["decode-0"] else None

        back_after = await eventually(recreated, "decode-0 recreated and registered", within=120)
        result = await load_result(load, within=120)
        (hook_s,) = _logged(caplog, "preStop hook done", "hook_s")  # the pod's real hook, in its namespaces
        (kill_s,) = _logged(caplog, "container killed", "kill_s")  # hook + SIGTERM until the process was gone
        print(
            f"\nhung decode: container gone {killed_after:.1f} s after the hang (preStop {hook_s:.2f} s, kill "
            f"{kill_s:.2f} s), group registered again with the next epoch after {back_after:.1f} s; load "
            f"{result['ok']} ok, {result['cut_mid_stream']} cut, {len(result['failed_before_first_byte'])} failed "
            "before the first byte (one decode group)"
        )
        assert hook_s < 5  # the hook gave up on the hung leader (its /ready answered 503) instead of waiting 600 s
        # found within the timeout + one period, killed within the probe's grace (not the 630 s of the pod's)
        assert killed_after < HEALTH_TIMEOUT_S + 10 + 5 + PROBE_GRACE_S
        assert (await sim.reg.endpoints(ns, "sim"))["decode-0"].epoch == before["decode-0"] + 1
        after = {p.metadata.name: p.metadata.uid for p in await pods(live.api, ns)}
        assert after["sim-decode-0-0"] != uids["sim-decode-0-0"]
        assert after["sim-prefill-0-0"] == uids["sim-prefill-0-0"]  # the prefill group was not touched
