"""The K2.6 recipe's shape with HiCache on the Mooncake Store, on the dev cluster: the operator renders the pods,
the pod runner runs each pod's ``tandem sim`` in the pod's own network namespace with the rendered env, and every
prefill rank opens the real Store client (``tandem_sim.pd.mooncake_store``) against a real ``mooncake_master`` run as
the chart runs it (HA on its own etcd, ``--cluster_id=tandem``), both reached at the pod network's gateway.

- With the env the operator renders, the 8-rank prefill serves through the router and a repeated prompt is read
  back from the Store (``tandem_sim:hicache_storage_hit_tokens_total`` on the prefill pod).
- With the env it rendered before this change (TE metadata in etcd, Mooncake's default Store cluster id and local
  hostname; set here through the role's ``env``, which wins over the operator's), the prefill's container dies at
  start with SGLang's "Failed to setup Mooncake store" and never gets Ready.
"""

from __future__ import annotations

import asyncio
import copy
import sys
from pathlib import Path
from typing import Any

import aiohttp
import openai
import pytest

from tandem_dev.devcluster.podrunner import PodRunner
from tandem_dev.procs import ManagedProcess, free_port
from tests.operator.live import (
    SIM_MODEL,
    SIM_SPEC,
    Live,
    create_pdcluster,
    operator_process,
    pdcluster,
    pods,
    sim_stack,
)
from tests.tandem_dev.devcluster.devcluster_fixtures import eventually

pytestmark = [pytest.mark.k8s, pytest.mark.netns, pytest.mark.procs, pytest.mark.slow, pytest.mark.timeout(420)]

RANKS = 8
PAGE = 64


@pytest.fixture
def store(live: Live) -> str:
    """Mooncake's own etcd and an HA mooncake_master on it, both on the pod network's gateway: the etcd URL."""
    network = live.cluster.pod_network
    assert network is not None
    gateway, client, peer = network.gateway, free_port(), free_port()
    url, peer_url = f"http://{gateway}:{client}", f"http://127.0.0.1:{peer}"
    etcd_argv = [
        "etcd", "--name", "mc", "--data-dir", str(live.tmp / "mc-etcd"),
        "--listen-client-urls", url, "--advertise-client-urls", url,
        "--listen-peer-urls", peer_url, "--initial-advertise-peer-urls", peer_url,
        "--initial-cluster", f"mc={peer_url}",
    ]  # fmt: skip
    etcd = ManagedProcess("mooncake-etcd", etcd_argv, live.tmp / "mc-etcd.log").start()
    live.procs.append(etcd)
    etcd.wait_http(f"{url}/health", timeout=30)
    master_argv = [
        str(Path(sys.executable).parent / "mooncake_master"), "--enable_ha=true", "--ha_backend_type=etcd",
        f"--etcd_endpoints={gateway}:{client}", "--cluster_id=tandem", f"--rpc_port={free_port()}",
        f"--metrics_port={free_port()}", f"--rpc_address={gateway}",
    ]  # fmt: skip
    live.procs.append(ManagedProcess("mooncake-master", master_argv, live.tmp / "mc-master.log").start())
    return url


def _spec(live: Live, store_url: str, env: list[dict[str, str]] | None = None) -> dict[str, Any]:
    """The dev cluster's simulated PDCluster with the K2.6 prefill's shape: 8 ranks a pod, HiCache on the Store."""
    prefill = {
        **SIM_SPEC["prefill"], "gpusPerNode": RANKS, "tpSize": RANKS,
        "hicache": {
            "enabled": True, "hostMemoryGib": 1, "storageBackend": "mooncake",
            "mooncakeStore": {"masterHa": True, "globalSegmentGib": 1},
        },
        "env": env or [],
    }  # fmt: skip
    # Batch-invariant kernels: the repeated prompt's answer equals the first one token for token whatever the batch
    # around it (the router's canaries share it), so a difference can only come from the KV read back from the Store.
    return {
        "prefill": prefill,
        "etcd": {"endpoints": [live.etcd], "mooncakeEndpoints": [store_url]},
        "deterministicInference": True,
    }


async def _hits(api: Any, namespace: str) -> float:
    (prefill,) = [p for p in await pods(api, namespace) if "-prefill-" in p.metadata.name]
    port = next(p.container_port for p in prefill.spec.containers[0].ports if p.name == "http")
    async with aiohttp.ClientSession() as http, http.get(f"http://{prefill.status.pod_ip}:{port}/metrics") as resp:
        text = await resp.text()
    return sum(
        float(line.rsplit(" ", 1)[1])
        for line in text.splitlines()
        if line.startswith("tandem_sim:hicache_storage_hit_tokens_total")
    )


async def test_the_k26_prefill_shape_serves_and_reads_a_repeated_prompt_back_from_the_store(
    live: Live, store: str
) -> None:
    async with sim_stack(live, ["decode-0", "prefill-0"], **_spec(live, store)) as stack:
        prompt = " ".join(f"store{i}" for i in range(3 * PAGE))
        async with openai.AsyncOpenAI(base_url=stack.base_url, api_key="unused", max_retries=0, timeout=60) as sdk:
            answers = [
                (await sdk.completions.create(model=SIM_MODEL, prompt=prompt, max_tokens=4, temperature=0))
                .choices[0]
                .text
                for _ in range(2)
            ]
        assert answers[0] == answers[1]
        assert await _hits(live.api, live.ns) >= PAGE  # the second prefill read the prompt's pages from the Store


async def test_the_env_rendered_before_this_change_kills_the_prefill_at_start(live: Live, store: str) -> None:
    etcd_hosts = store.split("://", 1)[1]
    before = [
        {"name": "MOONCAKE_TE_META_DATA_SERVER", "value": f"etcd://{etcd_hosts}"},
        {"name": "MC_STORE_CLUSTER_ID", "value": "mooncake_cluster"},  # Mooncake's default: the id was not set
        {"name": "MOONCAKE_LOCAL_HOSTNAME", "value": "localhost"},  # SGLang's default: the name was not set
        {"name": "MC_STORE_CLIENT_SETUP_RETRIES", "value": "2"},  # Mooncake's default 20: a shorter wait here
    ]
    live.procs.append(operator_process(live.cluster, live.ns, live.etcd, live.tmp, "op").start())
    manifest = pdcluster("sim", simulated=True, **_spec(live, store, before))
    await create_pdcluster(live.api, live.ns, copy.deepcopy(manifest))
    (live.tmp / "pods").mkdir()
    async with PodRunner(live.api, live.tmp / "pods", namespace=live.ns).running_in_background():

        async def died() -> bool:
            logs = [p.read_text(errors="replace") for p in (live.tmp / "pods").glob("*prefill*.log")]
            return any("Failed to setup Mooncake store, error code" in log for log in logs)

        await eventually(died, "the prefill's Store failing at start-up", within=180)
        await asyncio.sleep(1)
        (prefill,) = [p for p in await pods(live.api, live.ns) if "-prefill-" in p.metadata.name]
        assert not any(c.type == "Ready" and c.status == "True" for c in prefill.status.conditions or ())
