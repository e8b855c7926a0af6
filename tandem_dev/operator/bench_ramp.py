"""Parts of ``tandem bench operator`` measured while the fleet ramps up: fences during the ramp, the operator's
API requests, and the scaling curve's tables.

A fence during the ramp: while the operator creates the fleet's pods, the benchmark deletes one member pod of a
prefill group (prefill groups are created first, so they exist early in the pass) every ``FENCE_EVERY_S``, and
times pod delete (wall clock just before the DELETE) -> the group's registry key deleted (the wall clock the
operator logs in its ``group fenced`` record, ``fenced_at``; both processes share the machine's clock). That covers
the API server's watch, kopf's event queue and the fast path, behind the ramp's own work on the same event loop.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import math
import os
import time
from collections.abc import Sequence
from dataclasses import dataclass, field
from pathlib import Path

import aiohttp
from kubernetes_asyncio import client, watch

from tandem_dev.bench import Plot, Table

FENCE_EVERY_S = 1.0
KUBE_REQUESTS_METRIC = "tandem_operator_kube_requests_total"


@dataclass
class RampFences:
    """Pods deleted during the ramp: name -> wall clock of the DELETE; filled in from the operator's log."""

    deleted: dict[str, float] = field(default_factory=dict)
    end_to_end_ms: list[float] = field(default_factory=list)  # pod delete -> key deleted
    operator_ms: list[float] = field(default_factory=list)  # the operator's own: event received -> key deleted
    watch_ms: list[float] = field(default_factory=list)  # pod delete -> the benchmark's own watch sees it

    def read_log(self, log: Path) -> None:
        """Match each deleted pod with the operator's ``group fenced`` record for it."""
        for line in log.read_text(errors="replace").splitlines():
            with contextlib.suppress(ValueError, KeyError, TypeError):
                record = json.loads(line)
                pod = record.get("pod")
                if record.get("msg") == "group fenced" and pod in self.deleted:
                    self.end_to_end_ms.append((float(record["fenced_at"]) - self.deleted.pop(pod)) * 1000)
                    self.operator_ms.append(float(record["fenced_ms"]))


async def fence_during_ramp(
    api: client.ApiClient, namespace: str, pods: Sequence[str], fences: RampFences, ramp_over: asyncio.Event
) -> None:
    """Delete ``pods`` one by one, ``FENCE_EVERY_S`` apart, each once it exists, until ``ramp_over``. A watch
    of the benchmark's own on each pod, established before the delete, times when the API server delivers the
    deletion to a watcher."""
    core = client.CoreV1Api(api)
    watchers: list[asyncio.Task[None]] = []
    for name in pods:
        watching = asyncio.Event()
        deleted: asyncio.Future[float] = asyncio.get_running_loop().create_future()
        watcher = asyncio.create_task(_watch_deletion(core, namespace, name, watching, deleted, fences))
        waits = [asyncio.create_task(watching.wait()), asyncio.create_task(ramp_over.wait())]
        await asyncio.wait(waits, return_when=asyncio.FIRST_COMPLETED)
        for task in waits:
            task.cancel()
        if ramp_over.is_set():
            watcher.cancel()
            break
        watchers.append(watcher)
        fences.deleted[name] = time.time()
        deleted.set_result(fences.deleted[name])
        await core.delete_namespaced_pod(name, namespace, _preload_content=False)
        await asyncio.sleep(FENCE_EVERY_S)
    await asyncio.gather(*watchers, return_exceptions=True)


async def _watch_deletion(
    core: client.CoreV1Api,
    namespace: str,
    name: str,
    watching: asyncio.Event,
    deleted: asyncio.Future[float],
    fences: RampFences,
) -> None:
    """Watch one pod until it exists (its first event), then until its deletion shows."""
    selector = f"metadata.name={name}"
    while True:
        async with watch.Watch() as pods:
            stream = pods.stream(core.list_namespaced_pod, namespace, field_selector=selector, timeout_seconds=120)
            async for event in stream:
                watching.set()
                gone = event["type"] == "DELETED" or (event["raw_object"].get("metadata") or {}).get(
                    "deletionTimestamp"
                )
                if gone and deleted.done():
                    fences.watch_ms.append((time.time() - deleted.result()) * 1000)
                    return


def percentile(values: Sequence[float], q: float) -> float:
    """Nearest-rank percentile (``q`` in 0..100); nan without values."""
    if not values:
        return float("nan")
    ordered = sorted(values)
    return ordered[max(0, math.ceil(q / 100 * len(ordered)) - 1)]


async def kube_requests(metrics_url: str) -> int:
    """The operator's Kubernetes API requests so far, from its ``/metrics``."""
    async with aiohttp.ClientSession() as session, session.get(metrics_url) as response:
        text = await response.text()
    return int(
        sum(float(line.rsplit(" ", 1)[1]) for line in text.splitlines() if line.startswith(KUBE_REQUESTS_METRIC))
    )


def load_average() -> float:
    return os.getloadavg()[0]


@dataclass(frozen=True)
class CurvePoint:
    groups: int
    nodes: int
    cluster_up_s: float
    ready_s: float
    registered_s: float
    rss_peak_mib: float
    requests: int
    fence_p99_ms: float
    fences: int
    load: float


def curve_tables(points: Sequence[CurvePoint]) -> list[Table]:
    time_table = Table(
        "operator scaling: one PDCluster of N groups x 4 nodes (8 GPUs each) on 4N kwok nodes",
        [
            "groups",
            "nodes",
            "dev cluster up s",
            "create -> all Ready s",
            "create -> all registered s",
            "fence p99 during ramp ms",
            "fences",
            "load avg",
        ],
        [
            [p.groups, p.nodes, p.cluster_up_s, p.ready_s, p.registered_s, p.fence_p99_ms, p.fences, p.load]
            for p in points
        ],
        notes=[
            "fence: pod delete -> registry key deleted, while the operator creates the fleet (one delete a second)",
            "load avg: the machine's 1-minute load average at the end of the ramp (2 cores, shared)",
        ],
        plot=Plot("line", "groups", ["create -> all Ready s", "create -> all registered s"], "seconds"),
    )
    memory_table = Table(
        "operator scaling: peak RSS and Kubernetes API requests",
        ["groups", "operator peak RSS MiB", "API requests (create -> all registered)"],
        [[p.groups, p.rss_peak_mib, p.requests] for p in points],
        notes=[
            "requests: the operator's own REST calls (tandem_operator_kube_requests_total; kopf's watches not counted)"
        ],
        plot=Plot("line", "groups", ["operator peak RSS MiB"], "MiB"),
    )
    return [time_table, memory_table]
