"""A node that turns NotReady on the real control plane (issue #34): a blip costs no reload, a lost node does.

The node's kubelet is cut off the way a kubelet-lease or API-server blip cuts it: its Lease is no longer renewed
(``tandem_dev.devcluster.nodefaults``), kube-controller-manager's node lifecycle controller sets the node's Ready
condition Unknown after its node-monitor grace (50 s), taints it unreachable and marks its pods NotReady. The pods'
processes keep running behind their IPs (only the control plane lost the node), as in such a blip.

Every worker pod requests 100 of a node's 192 CPUs, so each sits alone on its node and the cut node holds one
decode group only; the other decode group keeps serving the load.

- ``lifecycle.nodeLostGraceSeconds`` at its default (300 s): the node NotReady for 60 s under streaming load ->
  its group out of routing at once, the same pods and epoch registered again once the node is Ready, 0 recreations.
- the grace set to 30 s (for speed; the default would make the test wait 5 min) and the operator restarted while
  the node is NotReady: the new operator counts the grace from the node's Ready ``lastTransitionTime``, not from
  its own start, and recreates the group on another node with epoch + 1 when it runs out.
"""

from __future__ import annotations

import asyncio
import contextlib
import signal
import time
from collections.abc import AsyncIterator
from datetime import UTC, datetime
from typing import Any

import pytest
from kubernetes_asyncio import client

from tandem_dev.devcluster.nodefaults import cut_kubelet, not_ready, restore_kubelet, schedulable
from tandem_dev.devcluster.podrunner import PodRunner
from tandem_dev.records import Recorder
from tests.operator.live import (
    SIM_MODEL,
    Live,
    load_result,
    operator_process,
    pdc_status,
    pods,
    serves,
    sim_stack,
    start_load,
)
from tests.tandem_dev.devcluster.devcluster_fixtures import eventually

pytestmark = [pytest.mark.k8s, pytest.mark.netns]

ONE_NODE = {"nodesPerGroup": 1, "gpusPerNode": 1, "tpSize": 1, "epSize": 1, "moeA2ABackend": "none"}
ALONE = {"resources": {"requests": {"cpu": "100"}}}  # the dev cluster's nodes have 192 CPUs: one worker per node
PREFILL = {"groups": 1, **ONE_NODE, **ALONE}
DECODE = {"groups": 2, **ONE_NODE, **ALONE}
GROUPS = ["decode-0", "decode-1", "prefill-0"]
VICTIM = "sim-decode-0-0"
BLIP_S = 60.0
SHORT_GRACE_S = 30


def _since(condition: dict[str, Any]) -> float:
    """The wall-clock time (epoch seconds) of a condition's lastTransitionTime."""
    return datetime.fromisoformat(str(condition["lastTransitionTime"])).astimezone(UTC).timestamp()


@contextlib.asynccontextmanager
async def kubelet_cut(api: client.ApiClient, node: str, runner: PodRunner) -> AsyncIterator[None]:
    """``node``'s kubelet off the API server while the context is open; on exit it is back, the node Ready and
    untainted (the dev cluster is shared by the session's tests) and its pods' statuses synced again."""
    await cut_kubelet(api, node)
    try:
        yield
    finally:
        await restore_kubelet(api, node)
        await eventually(lambda: schedulable(api, node), f"{node} Ready and untainted again", within=120)
        await runner.resync(node)


async def _pod(api: client.ApiClient, ns: str, name: str) -> client.V1Pod | None:
    try:
        pod: client.V1Pod = await client.CoreV1Api(api).read_namespaced_pod(name, ns)
    except client.ApiException as err:
        if err.status == 404:
            return None
        raise
    return pod


async def _fence_records(api: client.ApiClient, ns: str) -> dict[str, str]:
    services = await client.CoreV1Api(api).list_namespaced_service(ns, label_selector="tandem.dev/cluster=sim")
    return {
        s.metadata.name: s.metadata.annotations["tandem.dev/fenced"]
        for s in services.items
        if "tandem.dev/fenced" in (s.metadata.annotations or {})
    }


@pytest.mark.timeout(540)
async def test_a_node_notready_for_60s_under_load_costs_no_recreation(live: Live, record: Recorder) -> None:
    api, ns = live.api, live.ns
    async with sim_stack(live, GROUPS, prefill=PREFILL, decode=DECODE) as sim:
        reg = sim.reg
        before = {g: e.epoch for g, e in (await reg.endpoints(ns, "sim")).items()}
        uids = {p.metadata.name: p.metadata.uid for p in await pods(api, ns)}
        victim = await _pod(api, ns, VICTIM)
        assert victim is not None
        node = victim.spec.node_name
        assert [p.metadata.name for p in await pods(api, ns) if p.spec.node_name == node] == [VICTIM]

        load = await start_load(sim.base_url, SIM_MODEL, 8, 600, max_tokens=32)  # ended by SIGTERM below
        async with kubelet_cut(api, node, sim.runner):
            condition = await eventually(lambda: not_ready(api, node), f"{node} NotReady", within=120)
            since = _since(condition)

            async def unrouted() -> float | None:
                return time.time() if "decode-0" not in await reg.endpoints(ns, "sim") else None

            unrouted_at = await eventually(unrouted, "decode-0 out of rotation", within=30)
            # The blip: the node stays NotReady for BLIP_S. Meanwhile nothing is recreated and decode-0 stays out.
            while time.time() < since + BLIP_S:
                assert await not_ready(api, node) is not None, "the node came back by itself"
                assert "decode-0" not in await reg.endpoints(ns, "sim")
                assert {p.metadata.name: p.metadata.uid for p in await pods(api, ns)} == uids
                await asyncio.sleep(1.0)
        ready_at = time.time()  # the node is Ready and untainted, its pods' statuses synced

        async def registered() -> dict[str, int] | None:
            entries = {g: e.epoch for g, e in (await reg.endpoints(ns, "sim")).items()}
            return entries if sorted(entries) == GROUPS else None

        back = await eventually(registered, "decode-0 registered again", within=60)
        back_s = time.time() - ready_at
        load.send_signal(signal.SIGTERM)
        result = await load_result(load, within=90)
        status = await pdc_status(api, ns, "sim")
        print(
            f"\n{node} NotReady {ready_at - since:.0f} s (default grace); decode-0 unrouted "
            f"{unrouted_at - since:.1f} s after the node's Ready condition turned (1 s resolution), routed again "
            f"{back_s:.1f} s after the node was Ready; epochs {before} -> {back}; recoveries "
            f"{status.get('recoveries', 0)}; load {result['ok']} ok, {result['cut_mid_stream']} cut, "
            f"{len(result['failed_before_first_byte'])} failed before a byte"
        )
        record(
            {
                "not_ready_s": ready_at - since,
                "unrouted_after_s": unrouted_at - since,
                "routed_again_after_ready_s": back_s,
                "epochs_before": before,
                "epochs_after": back,
                "recoveries": status.get("recoveries", 0),
                "load": {
                    "ok": result["ok"],
                    "cut_mid_stream": result["cut_mid_stream"],
                    "failed_before_first_byte": len(result["failed_before_first_byte"]),
                },
            }
        )
        assert back == before  # the same incarnations: nothing recreated
        assert {p.metadata.name: p.metadata.uid for p in await pods(api, ns)} == uids  # no pod deleted
        assert await _fence_records(api, ns) == {}
        assert status.get("recoveries", 0) == 0
        assert result["failed_before_first_byte"] == []
        assert result["cut_mid_stream"] == 0  # the data path never broke: only the control plane lost the node
        assert result["ok"] > 0
        await eventually(lambda: serves(sim.base_url, SIM_MODEL), "a completion after the blip", within=30)


@pytest.mark.timeout(480)
async def test_a_node_notready_past_the_grace_recreates_its_group_also_across_an_operator_restart(
    live: Live, record: Recorder
) -> None:
    api, ns = live.api, live.ns
    lifecycle = {"nodeLostGraceSeconds": SHORT_GRACE_S}
    async with sim_stack(live, GROUPS, prefill=PREFILL, decode=DECODE, lifecycle=lifecycle) as sim:
        reg = sim.reg
        before = (await reg.endpoints(ns, "sim"))["decode-0"].epoch
        victim = await _pod(api, ns, VICTIM)
        assert victim is not None
        node, old_uid = victim.spec.node_name, victim.metadata.uid
        (first,) = [p for p in live.procs if p.name == "operator-op"]
        async with kubelet_cut(api, node, sim.runner):
            condition = await eventually(lambda: not_ready(api, node), f"{node} NotReady", within=120)
            since = _since(condition)

            async def unrouted() -> bool:
                return "decode-0" not in await reg.endpoints(ns, "sim")

            await eventually(unrouted, "decode-0 out of rotation", within=30)
            await asyncio.to_thread(first.stop)
            # The operator is away for half the grace: a successor that counted the grace from its own start
            # would recreate the group SHORT_GRACE_S / 2 late.
            await asyncio.sleep(max(0.0, since + SHORT_GRACE_S / 2 - time.time()))
            live.procs.append(operator_process(live.cluster, ns, live.etcd, live.tmp, "op-b").start())

            async def replaced() -> float | None:
                pod = await _pod(api, ns, VICTIM)
                return time.time() if pod is None or pod.metadata.uid != old_uid else None

            replaced_at = await eventually(replaced, f"{VICTIM} deleted", within=SHORT_GRACE_S + 60)
            fenced_after_s = replaced_at - since

            async def registered_again() -> int | None:
                endpoint = (await reg.endpoints(ns, "sim")).get("decode-0")
                return endpoint.epoch if endpoint is not None and endpoint.epoch > before else None

            after = await eventually(registered_again, "decode-0 recreated and registered", within=90)
            recreated_s = time.time() - since
            new = await _pod(api, ns, VICTIM)
            assert new is not None
            print(
                f"\n{node} NotReady with nodeLostGraceSeconds {SHORT_GRACE_S}, operator restarted after "
                f"{SHORT_GRACE_S / 2:.0f} s: decode-0's pod deleted {fenced_after_s:.1f} s and the group registered "
                f"again (epoch {before} -> {after}, on {new.spec.node_name}) {recreated_s:.1f} s after the node's "
                "Ready condition turned"
            )
            record(
                {
                    "node_lost_grace_s": SHORT_GRACE_S,
                    "operator_restarted_after_s": SHORT_GRACE_S / 2,
                    "pod_deleted_after_s": fenced_after_s,
                    "registered_again_after_s": recreated_s,
                    "epoch_before": before,
                    "epoch_after": after,
                }
            )
            assert SHORT_GRACE_S - 1 <= fenced_after_s < SHORT_GRACE_S + 10  # counted from the node, not the restart
            assert after == before + 1
            assert new.spec.node_name != node  # the unreachable node is tainted NoSchedule
            assert (await _fence_records(api, ns))["sim-decode-0"] == f"{before}/NodeLost"
        await eventually(lambda: serves(sim.base_url, SIM_MODEL), "a completion after the recreation", within=30)
