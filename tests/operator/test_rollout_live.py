"""Revision-coherent pairs on the real control plane: roll the worker image under streaming load; the router never
pairs across revisions and no request fails.

Changing ``spec.images.worker`` changes the compatibility revision of both roles. Each role creates a group of
the new revision first (``maxSurgeGroups: 1``); an old group is retired (unregistered, drained, deleted) only
once the other role has a Ready group of the new revision, so the router always has an old/old or new/new pair.
"""

from __future__ import annotations

import asyncio
import json

import aiohttp
import pytest
from prometheus_client.parser import text_string_to_metric_families

from tests.operator.live import SIM_MODEL, Live, load_result, pods, run_tool, sim_stack, start_load
from tests.tandem_dev.devcluster.devcluster_fixtures import eventually

pytestmark = [pytest.mark.k8s, pytest.mark.netns, pytest.mark.timeout(300)]
ONE_NODE = {"groups": 1, "nodesPerGroup": 1, "gpusPerNode": 1, "tpSize": 1, "epSize": 1, "moeA2ABackend": "none"}


async def _dispatches(url: str) -> dict[tuple[str, str], float]:
    async with aiohttp.ClientSession() as session, session.get(url) as resp:
        text = await resp.text()
    found: dict[tuple[str, str], float] = {}
    for family in text_string_to_metric_families(text):
        if family.name == "tandem_router_pair_dispatches":
            for sample in family.samples:
                if sample.name.endswith("_total"):
                    key = (sample.labels["prefill_revision"], sample.labels["decode_revision"])
                    found[key] = sample.value
    return found


async def test_rolling_the_worker_image_under_load_never_pairs_across_revisions(
    live: Live,
) -> None:
    ns = live.ns
    prefill = {**ONE_NODE}
    decode = {**ONE_NODE, "extraArgs": ["--sim-inter-token-ms=20"]}
    groups = ["decode-0", "prefill-0"]
    spec = {"prefill": prefill, "decode": decode}
    async with sim_stack(live, groups, **spec) as sim:
        reg, base_url = sim.reg, sim.base_url

        async def revisions() -> set[str]:
            return {e.revision for e in (await reg.endpoints(ns, "sim")).values()}

        (old,) = await revisions()
        load = await start_load(base_url, SIM_MODEL, 8, 45.0, max_tokens=50)
        await asyncio.sleep(3.0)
        patch = json.dumps({"spec": {"images": {"worker": "tandem-sglang-worker:0.5.23-rollout"}}})
        await run_tool(live.cluster, "kubectl", "-n", ns, "patch", "pdcluster/sim", "--type", "merge", "-p", patch)

        async def rolled() -> str | None:
            found = await revisions()
            names = [p.metadata.name for p in await pods(live.api, ns)]
            new = found - {old}
            done = len(found) == 1 and new and sorted(names) == ["sim-decode-1-0", "sim-prefill-1-0"]
            return new.pop() if done else None

        new = await eventually(rolled, "both roles rolled to the new revision and the old pods gone", within=150)
        result = await load_result(load, within=120)
        dispatches = await _dispatches(sim.metrics_url)
    failed = result["failed_before_first_byte"]
    print(
        f"\nrollout {old} -> {new}: load {result['ok']} ok, {result['cut_mid_stream']} cut, {len(failed)} failed "
        f"({failed[:1]}); dispatches by (prefill, decode) revision {dispatches}"
    )
    assert [pair for pair in dispatches if pair[0] != pair[1]] == []  # never across revisions
    assert dispatches.get((old, old), 0) > 0
    assert dispatches.get((new, new), 0) > 0
    assert result["failed_before_first_byte"] == []
    assert result["cut_mid_stream"] == 0
