"""deploy/sim-small.yaml scales decode 1 -> 2 -> 1 on the dev cluster, and every pod serves throughout.

The operator runs the PDCluster, the pod runner runs `tandem sim` in each pod's own network namespace with the
pod's real flags and env (the operator's fixed two-port Mooncake range in every pod), the router discovers workers
through the etcd registry. After the scale-up the new decode group is Ready (its readinessProbe passed against the
simulator) and answers requests through the router; after the scale-down every remaining pod still serves.
"""

from __future__ import annotations

import re
import sys
import time
from pathlib import Path
from typing import Any

import aiohttp
import openai
import pytest
from kubernetes_asyncio import client

from tandem_dev.devcluster.podrunner import PodRunner
from tandem_dev.procs import ManagedProcess, free_port
from tests.chart.stack import pdcluster_manifest
from tests.operator.live import Live, Registry, create_pdcluster, operator_process, pods, ready, run_tool
from tests.tandem_dev.devcluster.devcluster_fixtures import eventually

pytestmark = [pytest.mark.k8s, pytest.mark.netns, pytest.mark.timeout(420)]
MODEL = "kimi-k2.6-sim"


def _router(etcd_endpoint: str, namespace: str, log_dir: Path) -> tuple[ManagedProcess, str]:
    port = free_port()
    argv = [sys.executable, "-m", "tandem.cli", "router", "--host", "127.0.0.1", "--port", str(port)]
    argv += ["--discovery", "etcd", "--etcd-endpoint", etcd_endpoint.split("://", 1)[1]]
    argv += ["--cluster-namespace", namespace, "--cluster-name", "sim", "--policy", "round_robin"]
    return ManagedProcess("router", argv, log_dir / "router.log"), f"http://127.0.0.1:{port}"


async def _get(url: str) -> tuple[int, str] | None:
    try:
        async with aiohttp.ClientSession() as session, session.get(url, timeout=aiohttp.ClientTimeout(5)) as resp:
            return resp.status, await resp.text()
    except (aiohttp.ClientError, TimeoutError):
        return None


async def _every_pod_serves(api: client.ApiClient, namespace: str, expected: list[str]) -> bool:
    """The cluster's pods are exactly ``expected``, each Ready and answering /health on its own IP."""
    found = await pods(api, namespace)
    if sorted(p.metadata.name for p in found) != sorted(expected):
        return False
    for pod in found:
        if not any(c.type == "Ready" and c.status == "True" for c in pod.status.conditions or ()):
            return False
        port = next(p.container_port for p in pod.spec.containers[0].ports if p.name == "http")
        answer = await _get(f"http://{pod.status.pod_ip}:{port}/health")
        if answer is None or answer[0] != 200:
            return False
    return True


async def _requests_served(url: str) -> float:
    answer = await _get(f"{url}/metrics")
    assert answer is not None
    assert answer[0] == 200
    match = re.search(r"^sglang:num_requests_total\{[^}]*\} ([0-9.e+]+)$", answer[1], re.MULTILINE)
    return float(match.group(1)) if match else 0.0


async def _complete(sdk: openai.AsyncOpenAI, n: int) -> None:
    for i in range(n):
        completion = await sdk.completions.create(model=MODEL, prompt=f"scale {i}", max_tokens=4)
        assert completion.choices[0].text


async def test_sim_small_scales_decode_one_two_one_with_every_pod_serving(
    live: Live,
    runner: PodRunner,
) -> None:
    ns = live.ns
    live.procs.append(operator_process(live.cluster, ns, live.etcd, live.tmp, "op-scale").start())
    manifest: dict[str, Any] = pdcluster_manifest(ns, live.etcd.split("://", 1)[1])
    await create_pdcluster(live.api, ns, manifest)
    router, url = _router(live.etcd, ns, live.tmp)
    live.procs.append(router.start())
    sdk = openai.AsyncOpenAI(base_url=f"{url}/v1", api_key="unused", max_retries=0, timeout=30)
    try:
        one = ["sim-decode-0-0", "sim-decode-0-1", "sim-prefill-0-0"]
        await eventually(lambda: _every_pod_serves(live.api, ns, one), "sim-small's pods serving", within=120)
        await eventually(lambda: ready(live.api, ns, "sim", 1, 1), "PDCluster sim Ready", within=60)
        await _complete(sdk, 2)

        scaled = time.monotonic()
        await run_tool(live.cluster, "kubectl", "-n", ns, "scale", "pdpool/sim-decode", "--replicas=2")
        await eventually(lambda: ready(live.api, ns, "sim", 1, 2), "two decode groups Ready", within=180)
        two = [*one, "sim-decode-1-0", "sim-decode-1-1"]
        await eventually(lambda: _every_pod_serves(live.api, ns, two), "all 5 pods serving", within=60)
        async with Registry(live.etcd) as reg:
            new = (await reg.endpoints(ns, "sim"))["decode-1"].url

            async def new_decode_served() -> bool:
                await _complete(sdk, 2)  # round robin over both decodes: the new one gets some
                return await _requests_served(new) > 0

            await eventually(new_decode_served, "a request through the router on the new decode", within=60)
            up_s = time.monotonic() - scaled

            await run_tool(live.cluster, "kubectl", "-n", ns, "scale", "pdpool/sim-decode", "--replicas=1")

            async def back_to_one() -> bool:
                return sorted(await reg.endpoints(ns, "sim")) == ["decode-0", "prefill-0"]

            await eventually(back_to_one, "decode-1 unregistered", within=60)
        await eventually(lambda: _every_pod_serves(live.api, ns, one), "the 3 pods left serving", within=60)
        await eventually(lambda: ready(live.api, ns, "sim", 1, 1), "PDCluster sim Ready with one decode", within=60)
        await _complete(sdk, 4)  # nothing routed to the removed group
        print(f"\nscale 1 -> 2: new decode answered through the router after {up_s:.1f} s")
    finally:
        await sdk.close()
