"""A decode leader deleted 10 times under load comes back each time under new Mooncake session ids and serves
again (issue #18), on the real control plane with the operator's own Mooncake windows (no test override).

Each pod has its own network namespace (tandem_dev/devcluster/podnet.py), and kwok hands a recreated pod the IP its
predecessor freed, so each new incarnation comes back at the old address, and only the rotated window keeps its
session ids new. The second
decode group is created after decode-0 was recreated once, so it holds window 0 while decode-0 moves through
windows 2..11 of 16 (``mooncakePorts: 32``).
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

import aiohttp
import pytest
from kubernetes_asyncio import client

from tandem.registry import Endpoint
from tandem_dev.devcluster.cluster import DevCluster
from tandem_dev.procs import ManagedProcess, free_port
from tests.operator.live import GROUP, SIM_SPEC, VERSION, Registry, create_pdcluster, operator_process, run_tool
from tests.tandem_dev.devcluster.devcluster_fixtures import eventually

pytestmark = [pytest.mark.k8s, pytest.mark.netns, pytest.mark.slow, pytest.mark.timeout(600)]
LOAD = Path(__file__).with_name("load_client.py")
MODEL = "kimi-k2.6-sim"
ROUNDS, STREAMS = 10, 16
LEADER = "sim-decode-0-0"


def _manifest() -> dict[str, object]:
    spec = copy.deepcopy(SIM_SPEC)
    spec["decode"] = {**spec["decode"], "nodesPerGroup": 1, "tpSize": 1}
    spec["decode"]["ports"] = {"http": 30001, "bootstrap": 8999, "distInit": 5001, "mooncakeRpc": 15100,
                               "mooncakePorts": 32}  # fmt: skip
    return {"apiVersion": f"{GROUP}/{VERSION}", "kind": "PDCluster", "metadata": {"name": "sim"}, "spec": spec}


async def _generated_tokens(url: str) -> float:
    try:
        async with aiohttp.ClientSession() as http, http.get(f"{url}/metrics", timeout=aiohttp.ClientTimeout(2)) as r:
            text = await r.text()
    except (aiohttp.ClientError, TimeoutError):
        return 0.0
    return sum(float(line.rsplit(" ", 1)[1]) for line in text.splitlines()
               if line.startswith("sglang:generation_tokens_total"))  # fmt: skip


async def _router_metric(url: str, name: str) -> float:
    async with aiohttp.ClientSession() as http, http.get(f"{url}/metrics") as resp:
        text = await resp.text()
    return sum(float(line.rsplit(" ", 1)[1]) for line in text.splitlines() if line.startswith(name))


@pytest.mark.usefixtures("tandem_crds", "runner")  # the CRDs installed; simulated workers behind the pods
async def test_a_decode_leader_recreated_10_times_at_its_old_address_serves_again_under_new_sessions(
    k8s_cluster: DevCluster,
    k8s_api: client.ApiClient,
    k8s_namespace: str,
    etcd_endpoint: str,
    tmp_path: Path,
    proc_factory: list[ManagedProcess],
) -> None:
    ns = k8s_namespace
    proc_factory.append(operator_process(k8s_cluster, ns, etcd_endpoint, tmp_path, "op-rotation").start())
    await create_pdcluster(k8s_api, ns, _manifest())
    core = client.CoreV1Api(k8s_api)
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
        recoveries: list[float] = []
        same_ip = 0
        try:
            for _ in range(ROUNDS):
                old = await eventually(partial(decode0, -1), "decode-0 registered")
                old_ip = (await core.read_namespaced_pod(LEADER, ns)).status.pod_ip
                deleted = time.monotonic()
                await core.delete_namespaced_pod(LEADER, ns)
                new = await eventually(partial(decode0, old.epoch), "decode-0 registered again", within=120)

                async def serves(url: str = new.url) -> bool:
                    return await _generated_tokens(url) > 0  # the new incarnation produced tokens for a client

                await eventually(serves, f"decode-0 epoch {new.epoch} serving through the router", within=60)
                recoveries.append(time.monotonic() - deleted)
                new_ip = (await core.read_namespaced_pod(LEADER, ns)).status.pod_ip
                same_ip += new_ip == old_ip
                assert new.epoch == old.epoch + 1
                assert new.mooncake_sessions
                assert not set(new.mooncake_sessions) & set(old.mooncake_sessions)
        finally:
            load.terminate()  # the client finishes its streams in flight, then reports
            async with asyncio.timeout(60):
                out, _ = await load.communicate()
        outcome = json.loads(out.decode().strip().splitlines()[-1])
        print(f"\ndecode-0 recreated {ROUNDS} times ({same_ip} at its old IP): delete -> serving again "
              f"p50 {statistics.median(recoveries):.2f} s, max {max(recoveries):.2f} s "
              f"({[round(r, 2) for r in recoveries]}); load: {outcome['ok']} ok, {outcome['cut_mid_stream']} cut "
              f"mid-stream, {len(outcome['failed_before_first_byte'])} failed before their first byte")  # fmt: skip
        assert max(recoveries) < 60
        assert outcome["failed_before_first_byte"] == []
        assert outcome["ok"] > ROUNDS * STREAMS
        assert await _router_metric(router_url, "tandem_router_mooncake_session_reuses_total") == 0
