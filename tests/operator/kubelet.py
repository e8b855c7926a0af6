"""A test's stand-in for the kubelet's readiness prober on one dev-cluster pod.

kwok marks pods Ready once and never probes them. This runs the pod's own ``readinessProbe`` (httpGet path, port,
period, timeout, failure threshold) against the process behind the pod's IP and writes the pod's Ready condition
through the status subresource, as a kubelet does.
"""

from __future__ import annotations

import asyncio
import contextlib
from collections.abc import AsyncIterator
from datetime import UTC, datetime
from typing import Any

import aiohttp
from kubernetes_asyncio import client


def _port(container: dict[str, Any], port: object) -> int:
    if isinstance(port, int):
        return port
    return int(next(p["containerPort"] for p in container["ports"] if p["name"] == port))


async def _set_ready(api: client.ApiClient, ns: str, name: str, ready: bool) -> None:
    now = datetime.now(UTC).strftime("%Y-%m-%dT%H:%M:%SZ")
    value = "True" if ready else "False"
    conditions = [{"type": kind, "status": value, "lastTransitionTime": now} for kind in ("Ready", "ContainersReady")]
    await client.CoreV1Api(api).patch_namespaced_pod_status(name, ns, {"status": {"conditions": conditions}})


async def _probe_loop(api: client.ApiClient, ns: str, name: str, transitions: list[bool]) -> None:
    raw = api.sanitize_for_serialization(await client.CoreV1Api(api).read_namespaced_pod(name, ns))
    container = raw["spec"]["containers"][0]
    probe = container["readinessProbe"]
    url = f"http://{raw['status']['podIP']}:{_port(container, probe['httpGet']['port'])}{probe['httpGet']['path']}"
    failures, ready = 0, True
    async with aiohttp.ClientSession() as session:
        while True:
            try:
                async with session.get(url, timeout=aiohttp.ClientTimeout(total=probe["timeoutSeconds"])) as resp:
                    ok = 200 <= resp.status < 400
            except (aiohttp.ClientError, TimeoutError):
                ok = False
            failures = 0 if ok else failures + 1
            want = ready if not ok and failures < probe["failureThreshold"] else ok
            if want != ready:
                ready = want
                transitions.append(ready)
                await _set_ready(api, ns, name, ready)
            await asyncio.sleep(probe["periodSeconds"])


@contextlib.asynccontextmanager
async def readiness_prober(api: client.ApiClient, ns: str, name: str) -> AsyncIterator[list[bool]]:
    """Probe pod ``name`` while the context is open; yields the Ready transitions it wrote (False, True, ...)."""
    transitions: list[bool] = []
    task = asyncio.create_task(_probe_loop(api, ns, name, transitions))
    try:
        yield transitions
    finally:
        task.cancel()
        with contextlib.suppress(asyncio.CancelledError):
            await task
