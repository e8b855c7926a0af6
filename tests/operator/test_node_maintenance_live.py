"""Node maintenance and rollouts without spare nodes on the real control plane (issue #34, parts 3 and 4).

Every worker pod requests 100 of a node's 192 CPUs, so each sits alone on its node (as an 8-GPU pod on an 8-GPU
node).

- ``kubectl drain`` of decode-0's node under streaming load: the group's PodDisruptionBudget (``maxUnavailable: 0``)
  refuses the evictions while the operator, which saw the cordon, drains the group (unregister, in-flight streams
  end, pods deleted) and creates its replacement on another node; then the eviction goes through and the drain
  completes. 0 streams fail, none needs the router's resume.
- A worker-image rollout with no spare node (both roles' pods pinned to one topology block of 4 nodes, 2 prefill
  + 2 decode groups): with ``maxSurgeGroups: 1`` the surge groups stay Pending (the scheduler reports them
  Unschedulable) and nothing is retired; with ``maxSurgeGroups: 0`` (in place) the rollout completes on the same 4
  nodes under load, never pairing across revisions.
"""

from __future__ import annotations

import asyncio
import json
import os
import time

import aiohttp
import pytest
from kubernetes_asyncio import client
from prometheus_client.parser import text_string_to_metric_families

from tandem_dev.devcluster.nodes import BLOCK_LABEL
from tests.operator.live import SIM_MODEL, Live, load_result, pods, run_tool, sim_stack, start_load
from tests.tandem_dev.devcluster.devcluster_fixtures import eventually

pytestmark = [pytest.mark.k8s, pytest.mark.netns, pytest.mark.timeout(600)]
ONE_NODE = {"nodesPerGroup": 1, "gpusPerNode": 1, "tpSize": 1, "epSize": 1, "moeA2ABackend": "none"}
ALONE = {"resources": {"requests": {"cpu": "100"}}}  # the dev cluster's nodes have 192 CPUs: one worker per node
SLOW_DECODE = ["--sim-inter-token-ms=20"]  # a 100-token stream lasts ~2 s: streams are in flight when a group goes
DRAIN_TIMEOUT_S = 600  # lifecycle.drainTimeoutSeconds' default; kubectl drain is given as long


async def _router_counters(url: str, name: str) -> dict[tuple[str, ...], float]:
    """The router's counter ``name`` (without ``_total``) by its label values."""
    async with aiohttp.ClientSession() as session, session.get(url) as resp:
        text = await resp.text()
    found: dict[tuple[str, ...], float] = {}
    for family in text_string_to_metric_families(text):
        if family.name == name:
            for sample in family.samples:
                if sample.name.endswith("_total"):
                    found[tuple(sample.labels.values())] = sample.value
    return found


async def _kubectl(live: Live, *args: str, within: float) -> tuple[int, str]:
    """kubectl of the dev cluster with a longer budget than ``run_tool``'s; (exit code, stdout + stderr)."""
    proc = await asyncio.create_subprocess_exec(
        str(live.cluster.tool("kubectl")),
        *args,
        env={**os.environ, **live.cluster.env()},
        stdout=asyncio.subprocess.PIPE,
        stderr=asyncio.subprocess.STDOUT,
    )
    async with asyncio.timeout(within):
        out, _ = await proc.communicate()
    assert proc.returncode is not None
    return proc.returncode, out.decode()


async def test_kubectl_drain_completes_and_the_group_moves_under_load(live: Live) -> None:
    ns = live.ns
    prefill = {"groups": 1, **ONE_NODE, **ALONE}
    decode = {"groups": 2, **ONE_NODE, **ALONE, "extraArgs": SLOW_DECODE}
    async with sim_stack(live, ["decode-0", "decode-1", "prefill-0"], prefill=prefill, decode=decode) as sim:
        (victim,) = [p for p in await pods(live.api, ns) if p.metadata.name == "sim-decode-0-0"]
        node = victim.spec.node_name
        assert await _evict(live.api, ns, "sim-decode-1-0") == 429  # a serving group's pods: refused
        load = await start_load(sim.base_url, SIM_MODEL, 16, 30.0, max_tokens=100)
        await asyncio.sleep(4.0)  # every stream slot busy, both decodes streaming
        began = time.monotonic()
        try:
            code, out = await _kubectl(
                live,
                "drain",
                node,
                "--ignore-daemonsets",
                "--delete-emptydir-data",  # the workers' /dev/shm
                f"--timeout={DRAIN_TIMEOUT_S}s",
                within=DRAIN_TIMEOUT_S + 60,
            )
            drained_s = time.monotonic() - began
            assert code == 0, out
            attempts = out.count("evicting pod")  # kubectl prints it before each try (a refusal: retry in 5 s)

            async def moved() -> bool:
                entries = await sim.reg.endpoints(ns, "sim")
                return "decode-0" not in entries and sorted(entries) == ["decode-1", "decode-2", "prefill-0"]

            await eventually(moved, "decode-0 replaced by decode-2 on another node", within=120)
            moved_s = time.monotonic() - began
            placed = {p.metadata.name: p.spec.node_name for p in await pods(live.api, ns)}
            result = await load_result(load, within=120)
            resumed = await _router_counters(sim.metrics_url, "tandem_router_resumed_streams")
        finally:
            await run_tool(live.cluster, "kubectl", "uncordon", node)  # the dev cluster is shared by the session
    print(
        f"\nkubectl drain {node}: done {drained_s:.1f} s after it started ({attempts} eviction tries), decode-2 "
        f"registered {moved_s:.1f} s after; load {result['ok']} ok, "
        f"{result['cut_mid_stream']} cut mid-stream, {len(result['failed_before_first_byte'])} failed before a byte, "
        f"{sum(resumed.values()):.0f} resumed"
    )
    assert "sim-decode-0-0" not in placed
    assert placed["sim-decode-2-0"] != node
    assert node not in placed.values()
    assert result["cut_mid_stream"] == 0
    assert result["failed_before_first_byte"] == []
    assert sum(resumed.values()) == 0
    assert result["ok"] > 16


async def _evict(api: client.ApiClient, ns: str, name: str) -> int:
    """POST an Eviction for the pod (what kubectl drain does); the HTTP status."""
    body = client.V1Eviction(metadata=client.V1ObjectMeta(name=name, namespace=ns))
    try:
        await client.CoreV1Api(api).create_namespaced_pod_eviction(name, ns, body)
    except client.ApiException as err:
        return int(err.status)
    return 201


async def _unschedulable(api: client.ApiClient, ns: str, name: str) -> bool:
    """The pod exists and the scheduler found no node for it."""
    found = [p for p in await pods(api, ns) if p.metadata.name == name]
    conditions = (found[0].status.conditions or []) if found else []
    return any(c.type == "PodScheduled" and c.status == "False" and c.reason == "Unschedulable" for c in conditions)


async def test_a_rollout_without_a_spare_node_completes_in_place_and_surge_stays_pending(live: Live) -> None:
    ns = live.ns
    block = {"nodeSelector": {BLOCK_LABEL: "block-1"}}  # 4 nodes, one worker each: no spare node
    prefill = {"groups": 2, **ONE_NODE, **ALONE, **block}
    decode = {"groups": 2, **ONE_NODE, **ALONE, **block, "extraArgs": SLOW_DECODE}
    groups = ["decode-0", "decode-1", "prefill-0", "prefill-1"]
    async with sim_stack(live, groups, prefill=prefill, decode=decode) as sim:
        reg = sim.reg

        async def revisions() -> set[str]:
            return {e.revision for e in (await reg.endpoints(ns, "sim")).values()}

        (old,) = await revisions()
        image = json.dumps({"spec": {"images": {"worker": "tandem-sglang-worker:0.5.23-rollout"}}})
        await run_tool(live.cluster, "kubectl", "-n", ns, "patch", "pdcluster/sim", "--type", "merge", "-p", image)
        for name in ("sim-prefill-2-0", "sim-decode-2-0"):  # surge: a new group first, with no node to go to

            async def pending(name: str = name) -> bool:
                return await _unschedulable(live.api, ns, name)

            # the patch reaches the operator by its watch, or at the latest its 30 s resync, and a busy API server
            # (status patches timing out) slows the pass that creates the surge group
            await eventually(pending, f"{name} Pending: Unschedulable", within=120)
        assert sorted(await reg.endpoints(ns, "sim")) == groups  # nothing retired: the old groups serve on

        load = await start_load(sim.base_url, SIM_MODEL, 8, 60.0, max_tokens=50)
        await asyncio.sleep(3.0)
        began = time.monotonic()
        in_place = json.dumps({"spec": {"prefill": {"maxSurgeGroups": 0}, "decode": {"maxSurgeGroups": 0}}})
        await run_tool(live.cluster, "kubectl", "-n", ns, "patch", "pdcluster/sim", "--type", "merge", "-p", in_place)

        async def rolled() -> str | None:
            found = await revisions()
            entries = await reg.endpoints(ns, "sim")
            listed = await pods(live.api, ns)
            done = len(found) == 1 and old not in found and len(entries) == 4 and len(listed) == 4
            return found.pop() if done else None

        new = await eventually(rolled, "both roles rolled in place on the same 4 nodes", within=300)
        rolled_s = time.monotonic() - began
        nodes = {p.spec.node_name for p in await pods(live.api, ns)}
        result = await load_result(load, within=180)
        dispatches = await _router_counters(sim.metrics_url, "tandem_router_pair_dispatches")
    print(
        f"\nsurge: both surge groups Unschedulable, the 4 old groups kept serving; in place {old} -> {new}: "
        f"{rolled_s:.1f} s on {len(nodes)} nodes; load {result['ok']} ok, {result['cut_mid_stream']} cut, "
        f"{len(result['failed_before_first_byte'])} failed; dispatches by (prefill, decode) revision {dispatches}"
    )
    assert len(nodes) == 4
    assert [pair for pair in dispatches if pair[0] != pair[1]] == []  # never across revisions
    assert dispatches.get((new, new), 0) > 0
    assert result["cut_mid_stream"] == 0
    assert result["failed_before_first_byte"] == []
