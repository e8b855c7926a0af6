"""Health on the real control plane: a worker that is not ready (SGLang's ``/ready`` answers 503 while generation
is paused) leaves rotation and comes back with the same epoch and the same pods; a busy worker stays Ready; a
worker whose container exits has its group recreated.

The pod runner runs ``tandem sim`` behind each pod IP and, as the dev cluster's kubelet, runs each pod's own probes
against it (readiness ``/ready`` on the leader, liveness ``/health_generate``: desired/probes.py) and reports
container exits. The pause (``/pause_generation`` ``in_place``, ~20 s) stays shorter than the health-check timeout
the operator sets (45 s), so the liveness check it holds up passes once generation continues: readiness alone
moves. (A worker hung longer is killed: tests/operator/test_hung_worker_live.py.)
"""

from __future__ import annotations

import signal

import aiohttp
import pytest

from tests.operator.live import SIM_MODEL, Live, load_result, pods, serves, sim_stack, start_load
from tests.operator.readiness import ready_transitions
from tests.tandem_dev.devcluster.devcluster_fixtures import eventually

pytestmark = [pytest.mark.k8s, pytest.mark.netns, pytest.mark.timeout(300)]
ONE_NODE = {"groups": 1, "nodesPerGroup": 1, "gpusPerNode": 1, "tpSize": 1, "epSize": 1, "moeA2ABackend": "none"}


async def test_a_paused_worker_leaves_rotation_and_returns_without_recreation_an_exit_recreates(
    live: Live,
) -> None:
    ns = live.ns
    decode = {**ONE_NODE, "extraArgs": ["--sim-inter-token-ms=20"]}  # 2 s streams
    groups = ["decode-0", "prefill-0"]
    async with sim_stack(live, groups, decode=decode) as sim:
        reg, base_url = sim.reg, sim.base_url

        async def registered() -> dict[str, int] | None:
            entries = {g: e.epoch for g, e in (await reg.endpoints(ns, "sim")).items()}
            return entries if sorted(entries) == groups else None

        before = await eventually(registered, "prefill-0 and decode-0 registered", within=30)
        uids = {p.metadata.name: p.metadata.uid for p in await pods(live.api, ns)}
        (launch,) = [launch for launch, _ in sim.runner.running.values() if launch.pod == f"{ns}/sim-decode-0-0"]
        url = f"http://{launch.host}:{launch.port}"
        async with ready_transitions(live.api, ns, "sim-decode-0-0") as transitions:
            # busy is not unready: 16 streams for 10 s, no readiness transition
            result = await load_result(await start_load(base_url, SIM_MODEL, 16, 10, max_tokens=100), within=60)
            assert transitions == []
            async with aiohttp.ClientSession() as session:
                async with session.post(f"{url}/pause_generation", json={"mode": "in_place"}) as resp:
                    assert resp.status == 200

                async def unrouted() -> bool:
                    return "decode-0" not in await reg.endpoints(ns, "sim")

                await eventually(unrouted, "decode-0 out of rotation while paused", within=40)
                async with session.post(f"{url}/continue_generation", json={}) as resp:
                    assert resp.status == 200
            back = await eventually(registered, "decode-0 registered again once generation continued", within=60)

            async def ready_again() -> bool:  # the poll may see the pod's Ready condition after the operator did
                return transitions[:2] == [False, True]

            await eventually(ready_again, "the pod's Ready condition False then True", within=30)
        failed = len(result["failed_before_first_byte"])
        print(f"\nreadiness transitions {transitions}; load {result['ok']} ok, {failed} failed while busy")
        assert failed == 0
        assert back == before  # the same epochs: nothing was recreated
        assert {p.metadata.name: p.metadata.uid for p in await pods(live.api, ns)} == uids
        assert transitions[:2] == [False, True]
        await eventually(lambda: serves(base_url, SIM_MODEL), "a completion after decode-0 came back", within=30)

        # The container exits: the pod runner (restartPolicy Never) marks it terminated and the pod Failed.
        (process,) = [p for launch, p in sim.runner.running.values() if launch.pod == f"{ns}/sim-decode-0-0"]
        process.signal(signal.SIGKILL)

        async def recreated() -> int | None:
            endpoint = (await reg.endpoints(ns, "sim")).get("decode-0")
            return endpoint.epoch if endpoint is not None and endpoint.epoch > before["decode-0"] else None

        assert await eventually(recreated, "decode-0 recreated with a new epoch", within=90) == before["decode-0"] + 1
        after = {p.metadata.name: p.metadata.uid for p in await pods(live.api, ns)}
        assert after["sim-decode-0-0"] != uids["sim-decode-0-0"]
        assert after["sim-prefill-0-0"] == uids["sim-prefill-0-0"]
