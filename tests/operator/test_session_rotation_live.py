"""A decode leader deleted 24 times under load comes back each time and serves again, on the real control plane
with the operator's own Mooncake windows (issue #18, issue #41 item 2).

Each pod has its own network namespace (tandem_dev/devcluster/podnet.py); decode runs on a node of the test's own
whose pod IPs kwok draws from that node's pool alone, so each new incarnation comes back at the old address.
``mooncakePorts: 16`` gives decode-0's one-rank tcp pods 8 windows of 2 ports, as many as the shipped recipe's
(rdma, 8 ranks, 64 ports): consecutive
incarnations never share a session id, and from the 9th recreation on every incarnation takes the ids of the one 8
epochs back at the same address. The test proves that reuse safe for clients, at the pods' recovery defaults
(metadata refresh 2 s, failed-session probe 1-4 s): no stream fails or is cut, each reuse is counted by the router,
and each reused incarnation serves again. The second decode group is created after decode-0 was recreated once, so
it holds window 0.
"""

from __future__ import annotations

import asyncio
import copy
import json
import os
import statistics
import sys
import time
from functools import partial
from pathlib import Path
from typing import Any

import aiohttp
import pytest
from kubernetes_asyncio import client

from tandem.registry import Endpoint
from tandem_dev.devcluster.cluster import DevCluster
from tandem_dev.devcluster.nodes import fake_node
from tandem_dev.procs import ManagedProcess, free_port
from tests.operator.live import GROUP, SIM_SPEC, VERSION, Registry, create_pdcluster, operator_process, run_tool
from tests.tandem_dev.devcluster.devcluster_fixtures import create, eventually

pytestmark = [
    pytest.mark.k8s,
    pytest.mark.own_cluster,
    pytest.mark.netns,
    pytest.mark.slow,
    pytest.mark.timeout(1200),  # 24 rounds, ~15 s each
]
LOAD = Path(__file__).with_name("load_client.py")
MODEL = "kimi-k2.6-sim"
ROUNDS, STREAMS = 24, 16
WINDOWS = 8  # mooncakePorts 16 / 2 ports (one tcp rank): the recipe's count (64 ports / 8 rdma ranks)
LEADER = "sim-decode-0-0"
HOSTNAME = "kubernetes.io/hostname"


ROTATION_CIDR = (
    "127.10.255.1/28"  # kwok counts up from this address; the cluster's pool (from 127.10.0.1) never gets here
)


def _own_node(cluster: DevCluster) -> dict[str, Any]:
    """A GPU node of this test's own, with a pod CIDR: kwok then draws its pods' IPs from a pool of that node alone
    (``PodController.ipPool(node.Spec.PodCIDR)`` in kwok 0.7.0's pod_controller.go), so a recreated leader gets the
    one IP its predecessor freed back, as a hostNetwork pod keeps its node's. Without it every pod shares the
    cluster's pool, whose freed IPs kwok hands out in Go map order (``ipPool.Get``): on a dev cluster other tests
    have used, a recreated pod rarely gets its old IP, and the window wrap would go unseen."""
    index = cluster.config.nodes + 100  # past the cluster's own nodes: its own name and InternalIP
    node = fake_node(cluster.config, index)
    node["spec"] = {"podCIDR": ROTATION_CIDR}
    return node


def _manifest(node: str) -> dict[str, object]:
    spec = copy.deepcopy(SIM_SPEC)
    spec["decode"] = {**spec["decode"], "nodesPerGroup": 1, "tpSize": 1, "nodeSelector": {HOSTNAME: node}}
    spec["decode"]["ports"] = {"http": 30001, "bootstrap": 8999, "distInit": 5001, "mooncakeRpc": 15100,
                               "mooncakePorts": 16}  # fmt: skip
    return {"apiVersion": f"{GROUP}/{VERSION}", "kind": "PDCluster", "metadata": {"name": "sim"}, "spec": spec}


async def _generated_tokens(url: str) -> float:
    try:
        async with aiohttp.ClientSession() as http, http.get(f"{url}/metrics", timeout=aiohttp.ClientTimeout(2)) as r:
            text = await r.text()
    except (aiohttp.ClientError, TimeoutError):
        return 0.0
    return sum(float(line.rsplit(" ", 1)[1]) for line in text.splitlines()
               if line.startswith("sglang:generation_tokens_total"))  # fmt: skip


async def _metric(url: str, name: str) -> float:
    async with aiohttp.ClientSession() as http, http.get(f"{url}/metrics") as resp:
        text = await resp.text()
    return sum(float(line.rsplit(" ", 1)[1]) for line in text.splitlines() if line.startswith(name))


@pytest.mark.usefixtures("tandem_crds", "runner")  # the CRDs installed; simulated workers behind the pods
async def test_a_decode_leader_recreated_24_times_at_its_old_address_serves_again_through_window_wraps(
    k8s_cluster: DevCluster,
    k8s_api: client.ApiClient,
    k8s_namespace: str,
    etcd_endpoint: str,
    tmp_path: Path,
    proc_factory: list[ManagedProcess],
) -> None:
    ns = k8s_namespace
    proc_factory.append(operator_process(k8s_cluster, ns, etcd_endpoint, tmp_path, "op-rotation").start())
    core = client.CoreV1Api(k8s_api)
    node = _own_node(k8s_cluster)
    await create(k8s_api, "", node)
    try:
        await _rotate(k8s_cluster, k8s_api, ns, etcd_endpoint, tmp_path, proc_factory, node["metadata"]["name"])
    finally:
        await core.delete_node(node["metadata"]["name"])


async def _rotate(
    k8s_cluster: DevCluster,
    k8s_api: client.ApiClient,
    ns: str,
    etcd_endpoint: str,
    tmp_path: Path,
    proc_factory: list[ManagedProcess],
    node: str,
) -> None:
    core = client.CoreV1Api(k8s_api)
    await create_pdcluster(k8s_api, ns, _manifest(node))
    async with Registry(etcd_endpoint) as reg:

        async def decode0(after: int) -> Endpoint | None:
            endpoint = (await reg.endpoints(ns, "sim")).get("decode-0")
            return endpoint if endpoint is not None and endpoint.epoch > after else None

        await eventually(partial(decode0, -1), "decode-0 registered", within=120)
        await core.delete_namespaced_pod(LEADER, ns)  # decode-0 leaves window 0 for decode-1
        await eventually(partial(decode0, 0), "decode-0 registered at epoch 1", within=120)
        await run_tool(k8s_cluster, "kubectl", "-n", ns, "scale", "pdpool/sim-decode", "--replicas=2")

        async def both() -> bool:
            return {"prefill-0", "decode-0", "decode-1"} <= set(await reg.endpoints(ns, "sim"))

        await eventually(both, "prefill-0, decode-0 and decode-1 registered", within=120)
        router_port = free_port()
        router_url = f"http://127.0.0.1:{router_port}"
        argv = [sys.executable, "-m", "tandem.cli", "router", "--host", "127.0.0.1", "--port", str(router_port),
                "--discovery", "etcd", "--etcd-endpoint", etcd_endpoint.split("://", 1)[1],
                "--cluster-namespace", ns, "--cluster-name", "sim"]  # fmt: skip
        proc_factory.append(ManagedProcess("router", argv, tmp_path / "router.log").start())
        await asyncio.to_thread(proc_factory[-1].wait_http, f"{router_url}/readiness", 60.0)
        load = await asyncio.create_subprocess_exec(
            sys.executable, str(LOAD), f"{router_url}/v1", MODEL, str(STREAMS), "1000",
            stdout=asyncio.subprocess.PIPE, env={**os.environ, "PYTHONPATH": os.pathsep.join(sys.path)},
        )  # fmt: skip
        recoveries: list[tuple[float, bool]] = []  # (delete -> serving again, under ids an earlier one held)
        held: set[str] = set()  # session ids decode-0's incarnations registered so far
        same_ip = reused_rounds = 0
        try:
            for _ in range(ROUNDS):
                old = await eventually(partial(decode0, -1), "decode-0 registered")
                held |= set(old.mooncake_sessions)
                old_ip = (await core.read_namespaced_pod(LEADER, ns)).status.pod_ip
                deleted = time.monotonic()
                await core.delete_namespaced_pod(LEADER, ns)
                new = await eventually(partial(decode0, old.epoch), "decode-0 registered again", within=120)

                async def serves(url: str = new.url) -> bool:
                    return await _generated_tokens(url) > 0  # the new incarnation produced tokens for a client

                await eventually(serves, f"decode-0 epoch {new.epoch} serving through the router", within=60)
                reused = bool(set(new.mooncake_sessions) & held)
                recoveries.append((time.monotonic() - deleted, reused))
                reused_rounds += reused
                new_ip = (await core.read_namespaced_pod(LEADER, ns)).status.pod_ip
                same_ip += new_ip == old_ip
                assert new.epoch == old.epoch + 1
                assert new.mooncake_sessions
                assert not set(new.mooncake_sessions) & set(old.mooncake_sessions)  # never the previous one's
        finally:
            load.terminate()  # the client finishes its streams in flight, then reports
            async with asyncio.timeout(60):
                out, _ = await load.communicate()
        outcome = json.loads(out.decode().strip().splitlines()[-1])
        prefill = (await reg.endpoints(ns, "sim"))["prefill-0"]
        failed_sends = await _metric(prefill.url, "sglang:num_transfer_failed_reqs_total")
        fresh = [t for t, r in recoveries if not r]
        again = [t for t, r in recoveries if r]
        print(f"\ndecode-0 recreated {ROUNDS} times ({same_ip} at its old IP, {reused_rounds} under ids an earlier "
              f"incarnation held): delete -> serving again, new ids p50 {statistics.median(fresh):.2f} s max "
              f"{max(fresh):.2f} s, reused ids p50 {statistics.median(again):.2f} s max {max(again):.2f} s; "
              f"prefill-0 failed sends {failed_sends:.0f}; load: {outcome['ok']} ok, {outcome['cut_mid_stream']} cut "
              f"mid-stream, {len(outcome['failed_before_first_byte'])} failed before their first byte")  # fmt: skip
        assert same_ip == ROUNDS  # the node's own pool: the predecessor's freed IP is the only one to hand out
        assert reused_rounds >= ROUNDS - WINDOWS - 1  # the wrap happened: epochs 8 windows apart share their ids
        assert await _metric(router_url, "tandem_router_mooncake_session_reuses_total") == reused_rounds
        assert max(t for t, _ in recoveries) < 60
        assert outcome["failed_before_first_byte"] == []
        assert outcome["cut_mid_stream"] == 0
        assert outcome["ok"] > ROUNDS * STREAMS
