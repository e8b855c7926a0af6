"""The pod runner on the real control plane: a process appears behind a simulated SGLang pod's IP and goes away
with the pod.

The simulated SGLang worker (`tandem sim`, issue 2) is not on this branch yet, so this test runs a stand-in
process through the runner's ``launcher`` hook: Python's http.server bound to the pod IP and the pod's
``--port``. Everything else (the watch, the command translation, the pod IPs from kwok, the stop on delete) is
the real thing.
"""

from __future__ import annotations

import asyncio
import contextlib
import sys
from pathlib import Path

import aiohttp
import pytest
from kubernetes_asyncio import client

from tandem.devcluster.podrunner import Launch, PodRunner
from tests.devcluster_fixtures import create, eventually

pytestmark = [pytest.mark.k8s, pytest.mark.timeout(240)]


def http_server_stand_in(launch: Launch) -> list[str]:
    """Stand-in for `tandem sim` (not merged yet): serves HTTP on the pod IP and the SGLang --port."""
    return [sys.executable, "-m", "http.server", "--bind", launch.host, str(launch.port)]


def sglang_pod(name: str, image: str) -> dict[str, object]:
    container = {
        "name": "sglang",
        "image": image,
        "command": ["python3", "-m", "sglang.launch_server"],
        "args": ["--model-path", "/models/kimi", "--host", "0.0.0.0", "--port", "30000"],
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


async def test_pod_runner_serves_on_the_pod_ip_and_stops_with_the_pod(
    k8s_api: client.ApiClient, k8s_namespace: str, tmp_path: Path
) -> None:
    core = client.CoreV1Api(k8s_api)
    runner = PodRunner(k8s_api, tmp_path, launcher=http_server_stand_in, namespace=k8s_namespace)
    task = asyncio.create_task(runner.run())
    try:
        await create(k8s_api, k8s_namespace, sglang_pod("decode-0", "lmsysorg/sglang:v0.5.23-cu129"))
        await create(k8s_api, k8s_namespace, sglang_pod("not-sglang", "registry.invalid/other:1"))

        async def pod_ip() -> str | None:
            pod = await core.read_namespaced_pod("decode-0", k8s_namespace)
            return pod.status.pod_ip if pod.status.phase == "Running" else None

        ip = await eventually(pod_ip, "decode-0 to run with an IP")
        url = f"http://{ip}:30000/"
        assert await eventually(lambda: _http_status(url), f"a server on {url}", within=30) == 200
        launches = [launch for launch, _ in runner.running.values()]
        assert [launch.pod for launch in launches] == [f"{k8s_namespace}/decode-0"]
        assert launches[0].server_args == ("--model-path", "/models/kimi", "--port", "30000", "--host", ip)
        assert dict(launches[0].env) == {"POD_NAME": "decode-0"}
        (proc,) = [proc for _, proc in runner.running.values()]

        await core.delete_namespaced_pod("decode-0", k8s_namespace)

        async def stopped() -> bool:
            return not runner.running and not proc.alive() and await _http_status(url) is None

        await eventually(stopped, "the process to stop with its pod", within=30)
    finally:
        task.cancel()
        with contextlib.suppress(asyncio.CancelledError):
            await task
        await runner.stop_all()
