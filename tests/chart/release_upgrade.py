"""Helpers for upgrading a release of Tandem to this tree on the test control plane (tests/chart/
test_chart_upgrade_release_k8s.py): the release's code on the import path, streaming load through the routers'
Service, a rolling replacement of one local replica, and what the registry and the worker pods look like."""

from __future__ import annotations

import asyncio
import json
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import aiohttp
from kubernetes_asyncio import client
from openai import AsyncOpenAI, OpenAIError

from tandem import registry
from tandem.registry_etcd import client as etcd_client
from tests.chart.stack import EndpointLoad, LocalDeployment

SCHEMA_METRIC = "tandem_router_registry_entries_by_schema"


def release_env(tree: Path) -> dict[str, str]:
    """The environment that makes ``python -m tandem.cli`` import the release in ``tree`` (a ``git archive``):
    its four package roots first on the path, before this tree's editable install, and no current directory."""
    roots = [tree, tree / "simulator", tree / "router", tree / "operator"]
    return {"PYTHONPATH": ":".join(str(root) for root in roots), "PYTHONSAFEPATH": "1"}


@dataclass
class StreamLoad(EndpointLoad):
    """Streaming chat completions, unbounded until ``stop``; counts streams cut after their first chunk apart from
    those that failed before it."""

    max_requests: int = 10**9
    concurrency: int = 4
    cut_mid_stream: int = 0
    failed_before_first_byte: list[str] = field(default_factory=list)

    async def request(self, sdk: AsyncOpenAI, base: str, n: int) -> bool:
        received = False
        try:
            stream = await sdk.chat.completions.create(
                model=self.model,
                messages=[{"role": "user", "content": f"upgrade probe {n}"}],
                max_tokens=16,
                stream=True,
                timeout=30,
            )
            async for _ in stream:
                received = True
        except OpenAIError as err:
            if received:
                self.cut_mid_stream += 1
            else:
                at = time.strftime("%H:%M:%S", time.gmtime())
                self.failed_before_first_byte.append(f"{at} {base}: {type(err).__name__}: {err}")
            return False
        return True

    def summary(self) -> str:
        failed = len(self.failed_before_first_byte)
        return f"{self.ok} ok, {self.cut_mid_stream} cut, {failed} failed before the first byte"


async def roll(
    replica: LocalDeployment, args: list[str], env: dict[str, str], endpoints: list[str] | None, pre_stop_s: float
) -> None:
    """A rolling update of one replica (maxSurge 1, maxUnavailable 0) onto ``args`` and ``env``: the new one is
    Ready (and in the Service's ``endpoints``) before the old one leaves them; the old one runs its preStop sleep,
    then gets SIGTERM (and drains). ``endpoints`` None: not behind a Service (the operator)."""
    old, old_url = replica.current, replica.url
    assert old is not None
    replica.env = env
    port_flag, ready = ("--port", "/readiness") if endpoints is not None else ("--metrics-port", "/healthz")
    new_url = await asyncio.to_thread(replica.start, args, port_flag, (), ready)
    if endpoints is not None:
        endpoints.append(new_url)
        endpoints.remove(old_url)
    await asyncio.sleep(pre_stop_s)
    await asyncio.to_thread(old.stop, 30)


async def answers(url: str) -> bool:
    """``GET url`` answers 200."""
    try:
        async with aiohttp.ClientSession() as http, http.get(url) as resp:
            return resp.status == 200
    except aiohttp.ClientError:
        return False


async def schema_metric(router_url: str) -> dict[str, float] | None:
    """The router's registry entries by schema relation (``older``, ``current``, ...); None where the router has
    no such metric (routers from before registry schema versions)."""
    async with aiohttp.ClientSession() as http, http.get(f"{router_url}/metrics") as resp:
        assert resp.status == 200, await resp.text()
        text = await resp.text()
    found: dict[str, float] = {}
    for line in text.splitlines():
        if line.startswith(SCHEMA_METRIC + "{"):
            labels, value = line.rsplit(" ", 1)
            found[labels.split('relation="', 1)[1].split('"', 1)[0]] = float(value)
    return found if f"# TYPE {SCHEMA_METRIC} gauge" in text else None


async def stored_entries(etcd: str, namespace: str, cluster: str) -> list[dict[str, Any]]:
    """The registry entries of ``cluster`` as stored: the JSON objects the operator wrote."""
    etcd_api = etcd_client([f"http://{etcd}"])
    await etcd_api.connect()
    try:
        kvs = await etcd_api.get_prefix(registry.cluster_prefix(namespace, cluster).encode())
    finally:
        await etcd_api.close()
    return [json.loads(kv.value) for kv in kvs]


@dataclass(frozen=True)
class WorkerPod:
    """What tells a worker pod's incarnation and rendering apart."""

    name: str
    uid: str
    role: str
    revision: str
    template_hash: str
    restarts: int
    env: frozenset[str]


async def worker_pods(api: client.ApiClient, namespace: str, selector: str) -> list[WorkerPod]:
    """The worker pods that are not terminating."""
    listing = await client.CoreV1Api(api).list_namespaced_pod(namespace, label_selector=selector)
    found: list[WorkerPod] = []
    for pod in (p for p in listing.items if p.metadata.deletion_timestamp is None):
        labels = pod.metadata.labels or {}
        statuses = pod.status.container_statuses or []
        found.append(
            WorkerPod(
                name=pod.metadata.name,
                uid=pod.metadata.uid,
                role=labels.get("tandem.dev/role", ""),
                revision=labels.get("tandem.dev/revision", ""),
                template_hash=labels.get("tandem.dev/template-hash", ""),
                restarts=sum(s.restart_count or 0 for s in statuses),
                env=frozenset(f"{e.name}={e.value}" for e in pod.spec.containers[0].env or ()),
            )
        )
    return sorted(found, key=lambda p: p.name)


def condition(status: dict[str, Any], kind: str) -> dict[str, str]:
    """The status condition of type ``kind`` ({} when absent)."""
    found = [c for c in status.get("conditions") or [] if isinstance(c, dict) and c.get("type") == kind]
    return found[0] if found else {}
