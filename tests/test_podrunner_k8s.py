"""The pod runner on the real control plane: `tandem sim` serves behind a simulated SGLang pod's IP, with the
pod's own `python3 -m sglang.launch_server` flags, and goes away with the pod."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import aiohttp
import openai
import pytest
from kubernetes_asyncio import client

from tandem.devcluster.podrunner import PodRunner
from tests.devcluster_fixtures import create, eventually

pytestmark = [pytest.mark.k8s, pytest.mark.netns, pytest.mark.timeout(240)]


SERVER_ARGS = ["--model-path", "moonshotai/Kimi-K2.6", "--served-model-name", "kimi", "--trust-remote-code"]


def sglang_pod(name: str, image: str) -> dict[str, Any]:
    container = {
        "name": "sglang",
        "image": image,
        "command": ["python3", "-m", "sglang.launch_server"],
        "args": [*SERVER_ARGS, "--host", "0.0.0.0", "--port", "30000"],
        "env": [{"name": "POD_NAME", "valueFrom": {"fieldRef": {"fieldPath": "metadata.name"}}}],
        "resources": {"limits": {"nvidia.com/gpu": "8"}},
    }
    return {"apiVersion": "v1", "kind": "Pod", "metadata": {"name": name}, "spec": {"containers": [container]}}


async def _http_status(url: str) -> int | None:
    try:
        async with aiohttp.ClientSession() as session, session.get(url, timeout=aiohttp.ClientTimeout(2)) as resp:
            return resp.status
    except aiohttp.ClientError:
        return None


async def test_pod_runner_serves_tandem_sim_on_the_pod_ip_and_stops_it_with_the_pod(
    k8s_api: client.ApiClient, k8s_namespace: str, tmp_path: Path
) -> None:
    core = client.CoreV1Api(k8s_api)
    async with PodRunner(k8s_api, tmp_path, namespace=k8s_namespace).running_in_background() as runner:
        await create(k8s_api, k8s_namespace, sglang_pod("decode-0", "lmsysorg/sglang:v0.5.23-cu129"))
        await create(k8s_api, k8s_namespace, sglang_pod("not-sglang", "registry.invalid/other:1"))

        async def pod_ip() -> str | None:
            pod = await core.read_namespaced_pod("decode-0", k8s_namespace)
            return pod.status.pod_ip if pod.status.phase == "Running" else None

        ip = await eventually(pod_ip, "decode-0 to run with an IP")
        base = f"http://{ip}:30000"
        assert await eventually(lambda: _http_status(f"{base}/health"), f"tandem sim on {base}", within=90) == 200
        launches = [launch for launch, _ in runner.running.values()]
        assert [launch.pod for launch in launches] == [f"{k8s_namespace}/decode-0"]
        assert launches[0].server_args[-2:] == ("--host", ip)
        assert dict(launches[0].env) == {"POD_NAME": "decode-0"}

        async with openai.AsyncOpenAI(base_url=f"{base}/v1", api_key="unused") as sdk:
            assert [m.id for m in (await sdk.models.list()).data] == ["kimi"]
            completion = await sdk.completions.create(model="kimi", prompt="The pod runner", max_tokens=4)
            assert completion.choices[0].text

        (proc,) = [proc for _, proc in runner.running.values()]
        await core.delete_namespaced_pod("decode-0", k8s_namespace)

        async def stopped() -> bool:
            return not runner.running and not proc.alive() and await _http_status(f"{base}/health") is None

        await eventually(stopped, "tandem sim to stop with its pod", within=30)
