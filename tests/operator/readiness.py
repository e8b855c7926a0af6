"""Watch one dev-cluster pod's Ready condition, as the pod runner (the dev cluster's kubelet) sets it from the
pod's own readinessProbe."""

from __future__ import annotations

import asyncio
import contextlib
from collections.abc import AsyncIterator

from kubernetes_asyncio import client


async def _ready(core: client.CoreV1Api, ns: str, name: str) -> bool | None:
    try:
        pod = await core.read_namespaced_pod(name, ns)
    except client.ApiException:
        return None
    conditions = pod.status.conditions or []
    return any(c.type == "Ready" and c.status == "True" for c in conditions)


async def _watch(core: client.CoreV1Api, ns: str, name: str, transitions: list[bool], period: float) -> None:
    last = await _ready(core, ns, name)
    while True:
        await asyncio.sleep(period)
        now = await _ready(core, ns, name)
        if now is not None and now != last:
            transitions.append(now)
            last = now


@contextlib.asynccontextmanager
async def ready_transitions(
    api: client.ApiClient, ns: str, name: str, period: float = 0.25
) -> AsyncIterator[list[bool]]:
    """While the context is open, the Ready transitions of pod ``name`` (False, True, ...) as the API shows them."""
    transitions: list[bool] = []
    task = asyncio.create_task(_watch(client.CoreV1Api(api), ns, name, transitions, period))
    try:
        yield transitions
    finally:
        task.cancel()
        with contextlib.suppress(asyncio.CancelledError):
            await task
