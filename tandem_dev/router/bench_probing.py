"""``tandem bench probing``: what the integrity probing costs as the fleet grows, and how fast it still finds a
garbling decode (issue #40).

For each size (1 x 1, 8 x 8 and 125 x 125 prefills x decodes; quick mode: 1 x 1 and 8 x 8, shorter phases): a
real etcd, one fleet process serving every worker and registering them under one lease
(``tandem_dev.router.fleet_workers``: 20 ms per token, 8 requests at once per decode), and ``ROUTERS`` routers
with etcd discovery and default settings otherwise, each on its own port. A modest temperature-0 load (half
streaming, ``/generate``, answers of 24-48 tokens, clients spread over the routers) runs throughout:

* **phase A (clean)**: probing requests per second summed over the routers (``tandem_integrity_probes_total``)
  and the share of the cluster's capacity they held (``tandem_integrity_probe_seconds_total`` per second over
  ``tandem_integrity_probe_capacity_requests``), against the budget (``..._probe_budget_requests`` over the
  capacity, summed over the routers: each router's budget is its weight's part of the one cluster budget). The same
  two figures as the workers saw them (the router's ``canary-*`` request ids, over the fleet's
  true capacity), so the measure does not rest on the router's own accounting, and works with a router that does
  not export those metrics yet (they read as 0 there). Target: 0 clean pairs quarantined (``GET /integrity``).
* **phase B (a decode garbles)**: the last decode switched to the offload race at runtime; the time until every
  router has every pair of that decode out of traffic. Target: within ``OUT_WITHIN_S``. Also when the decode
  garbled its first answer (the race needs concurrent requests on it, which a lightly loaded decode of a large
  fleet rarely has), and the time to quarantine counted from then.

The load stays modest (``clients``): the 2-core machine runs etcd, the fleet, every router and the clients, and a
saturated machine would measure itself. Every process is started here and stopped by process group.
"""

from __future__ import annotations

import asyncio
import contextlib
import random
import socket
import sys
import tempfile
import time
from collections.abc import Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import aiohttp

from tandem_dev.bench import BenchArgs, Plot, Table
from tandem_dev.local_stack import CLUSTER, HOST, NAMESPACE, start_etcd
from tandem_dev.procs import ManagedProcess, ProcessFailedError, free_port
from tandem_dev.router.bench_integrity import bodies
from tandem_dev.router.integrity_stack import integrity_state, metric_values, metrics_of
from tandem_router.config import IntegritySettings

SIZES = ((1, 1), (8, 8), (125, 125))
QUICK_SIZES = ((1, 1), (8, 8))
ROUTERS = 4
CLEAN_S, QUICK_CLEAN_S = 60.0, 15.0  # full: two canary rounds (30 s apart on the wall clock)
WARMUP_S = 40.0  # the routers' first rounds and the first allowance of their budgets (up to 60 s of it) are spent
WATCH_S, QUICK_WATCH_S = 60.0, 30.0
OUT_WITHIN_S = 10.0
BUDGET_SHARE = IntegritySettings.model_fields["probe_budget_share"].default  # the router's default, for the note
MAX_RUNNING = 8  # the fleet's default per decode
PROBES = "tandem_integrity_probes_total"
PROBE_SECONDS = "tandem_integrity_probe_seconds_total"
BUDGET = "tandem_integrity_probe_budget_requests"
CAPACITY = "tandem_integrity_probe_capacity_requests"
SCRAPED = (PROBES, PROBE_SECONDS, BUDGET, CAPACITY)  # one /metrics scrape a router a snapshot
COLUMNS = (
    "size", "routers", "clients", "client req/s", "probes/s (routers)", "probes/s (workers saw)",
    "probing % of capacity (routers)", "probing % of capacity (workers saw)", "budget %", "time to quarantine s",
    "first garbled answer s", "quarantine after it s", "clean pairs quarantined", "garbled answers",
)  # fmt: skip
PLOTTED = ("probing % of capacity (routers)", "probing % of capacity (workers saw)")  # budget %: may be text


def clients_for(decodes: int) -> int:
    """Two closed-loop clients per decode (so a decode sees concurrent requests, which the race needs), at least 4
    and at most 48 (the 2-core machine runs everything)."""
    return max(4, min(48, 2 * decodes))


@dataclass
class Cluster:
    prefills: list[str]
    decodes: list[str]
    routers: list[str]
    fleet_url: str


@dataclass
class Load:
    ok: int = 0
    errors: int = 0


@dataclass
class Snapshot:
    """Counters at one moment: the routers' probe metrics and the workers' view."""

    at: float
    probes: float
    probe_seconds: float
    budgets: list[float]
    capacities: list[float]
    fleet: dict[str, float]


def _port_range(count: int) -> int:
    """A base port below the ephemeral range with ``count`` free ports above it (the routers and etcd take
    ephemeral ones, so they cannot collide)."""
    for base in random.sample(range(10_000, 32_000 - count, 50), 200):
        try:
            socks = []
            for port in range(base, base + count):
                sock = socket.socket()
                socks.append(sock)
                sock.bind((HOST, port))
            return base
        except OSError:
            continue
        finally:
            for sock in socks:
                sock.close()
    raise RuntimeError(f"no {count} consecutive free ports below 32000")


def start_cluster(work: Path, procs: list[ManagedProcess], prefills: int, decodes: int, routers: int) -> Cluster:
    """etcd, the fleet (registered) and the routers, each appended to ``procs`` as it starts."""
    etcd, endpoint = start_etcd(work, secure=False)
    procs.append(etcd)
    base = _port_range(2 * prefills + decodes)
    argv = [sys.executable, "-m", "tandem_dev.router.fleet_workers", "--prefills", str(prefills), "--decodes",
            str(decodes), "--base-port", str(base), "--etcd-endpoint", endpoint, "--max-running", str(MAX_RUNNING),
            "--namespace", NAMESPACE, "--cluster", CLUSTER]  # fmt: skip
    fleet = ManagedProcess("fleet", argv, work / "fleet.log").start()
    procs.append(fleet)
    fleet.wait_http(f"http://{HOST}:{base}/_fleet", timeout=120)
    urls = []
    for i in range(routers):
        port = free_port()
        argv = [sys.executable, "-m", "tandem.cli", "router", "--host", HOST, "--port", str(port), "--discovery",
                "etcd", "--etcd-endpoint", endpoint, "--cluster-namespace", NAMESPACE, "--cluster-name", CLUSTER,
                "--log-level", "warning"]  # fmt: skip
        procs.append(ManagedProcess(f"router{i}", argv, work / f"router{i}.log").start())
        urls.append(f"http://{HOST}:{port}")
    for proc, url in zip(procs[-routers:], urls, strict=True):
        proc.wait_http(f"{url}/readiness", timeout=120)
    return Cluster(
        [f"http://{HOST}:{base + i}" for i in range(prefills)],
        [f"http://{HOST}:{base + prefills + j}" for j in range(decodes)],
        urls,
        f"http://{HOST}:{base}",
    )


async def _all_available(sess: aiohttp.ClientSession, cluster: Cluster, within_s: float) -> None:
    """Until every router has every worker available (discovery and the first health checks done)."""
    want, until = len(cluster.prefills) + len(cluster.decodes), time.monotonic() + within_s
    while time.monotonic() < until:
        seen = [await metric_values(sess, url, "tandem_router_worker_available") for url in cluster.routers]
        if all(sum(1 for v in s.values() if v > 0) >= want for s in seen):
            return
        await asyncio.sleep(0.5)
    raise RuntimeError(f"the routers did not see all {want} workers available within {within_s:.0f}s")


async def run_load(
    sess: aiohttp.ClientSession, routers: list[str], work: list[dict[str, Any]], clients: int, stop: asyncio.Event
) -> Load:
    """``clients`` closed-loop clients, client ``i`` on router ``i % len(routers)``, every other one streaming."""
    load = Load()
    cursor = iter(range(1 << 62))

    async def client(i: int) -> None:
        url, stream = routers[i % len(routers)], i % 2 == 1
        while not stop.is_set():
            body = {**work[next(cursor) % len(work)], "stream": stream}
            try:
                async with sess.post(f"{url}/generate", json=body) as resp:
                    await resp.read()
                    ok = resp.status == 200
            except (aiohttp.ClientError, TimeoutError):
                ok = False
            load.ok += ok
            load.errors += not ok
            if not ok:
                await asyncio.sleep(0.2)  # a refusing router is not hammered

    await asyncio.gather(*(client(i) for i in range(clients)))
    return load


async def _snapshot(sess: aiohttp.ClientSession, cluster: Cluster) -> Snapshot:
    snap = Snapshot(time.monotonic(), 0.0, 0.0, [], [], {})
    for url in cluster.routers:
        values = {name: sum(v.values()) for name, v in (await metrics_of(sess, url, SCRAPED)).items()}
        snap.probes += values[PROBES]
        snap.probe_seconds += values[PROBE_SECONDS]
        snap.budgets.append(values[BUDGET])
        snap.capacities.append(values[CAPACITY])
    async with sess.get(f"{cluster.fleet_url}/_stats") as resp:
        snap.fleet = await resp.json()
    return snap


async def _quarantined(sess: aiohttp.ClientSession, cluster: Cluster) -> list[dict[str, Any]]:
    """Each router's ``/integrity`` document."""
    return list(await asyncio.gather(*(integrity_state(sess, url) for url in cluster.routers)))


@dataclass
class Outcome:
    clean_quarantined: set[tuple[str, str]] = field(default_factory=set)
    out_after: float | None = None
    switched_at: float = 0.0  # monotonic (the fleet's clock is this machine's)


def _note_clean(outcome: Outcome, docs: list[dict[str, Any]], bad: str | None) -> None:
    for doc in docs:
        outcome.clean_quarantined |= {(q["prefill"], q["decode"]) for q in doc["quarantined"] if q["decode"] != bad}


async def _watch_garbling(sess: aiohttp.ClientSession, cluster: Cluster, outcome: Outcome, seconds: float) -> None:
    """Switch the last decode to the race; poll every router until all have all its pairs out (or ``seconds``)."""
    bad = cluster.decodes[-1]
    pairs = {(p, bad) for p in cluster.prefills}
    async with sess.post(f"{bad}/tandem/sim/faults", json={"offload_race": True}) as resp:
        resp.raise_for_status()
    t0 = outcome.switched_at = time.monotonic()
    while time.monotonic() - t0 < seconds:
        docs = await _quarantined(sess, cluster)
        _note_clean(outcome, docs, bad)
        out = [bad in doc["quarantined_workers"] or pairs <= {(q["prefill"], q["decode"]) for q in doc["quarantined"]}
               for doc in docs]  # fmt: skip
        if all(out):
            outcome.out_after = time.monotonic() - t0
            return
        await asyncio.sleep(0.25)


def _diff(after: Snapshot, before: Snapshot, name: str) -> float:
    return float(after.fleet.get(name, 0.0)) - float(before.fleet.get(name, 0.0))


async def measure(cluster: Cluster, size: str, clean_s: float, watch_s: float) -> list[object]:
    clients = clients_for(len(cluster.decodes))
    true_capacity = len(cluster.decodes) * MAX_RUNNING
    stop = asyncio.Event()
    timeout = aiohttp.ClientTimeout(total=60)
    async with aiohttp.ClientSession(connector=aiohttp.TCPConnector(limit=0), timeout=timeout) as sess:
        await _all_available(sess, cluster, 120)
        work = bodies(400, seed=40, tokens=(24, 48))
        load_task = asyncio.create_task(run_load(sess, cluster.routers, work, clients, stop))
        try:
            await asyncio.sleep(WARMUP_S)  # phase A measures the steady state
            before = await _snapshot(sess, cluster)
            print(f"#   {size}: phase A, {clients} clients for {clean_s:.0f}s", flush=True)
            await asyncio.sleep(clean_s)
            after = await _snapshot(sess, cluster)
            requests_a = _diff(after, before, "client_requests")
            outcome = Outcome()
            _note_clean(outcome, await _quarantined(sess, cluster), None)
            print(f"#   {size}: phase B, a garbling decode, watched up to {watch_s:.0f}s", flush=True)
            garbled_before = float(after.fleet.get("garbled", 0.0))
            await _watch_garbling(sess, cluster, outcome, watch_s)
            final = await _snapshot(sess, cluster)
        finally:
            stop.set()
            load = await load_task
    dt = after.at - before.at
    budgets = [b / c * 100 for b, c in zip(after.budgets, after.capacities, strict=True) if c > 0]
    quarantine: object = round(outcome.out_after, 2) if outcome.out_after is not None else f"not within {watch_s:.0f}s"
    first_at = final.fleet.get("first_garbled_at")
    first: object = round(float(first_at) - outcome.switched_at, 2) if first_at is not None else "none"
    since_first: object = (
        round(outcome.out_after - (float(first_at) - outcome.switched_at), 2)
        if first_at is not None and outcome.out_after is not None
        else "-"
    )
    print(f"#   {size}: {load.ok} answers, {load.errors} errors", flush=True)
    return [
        size, len(cluster.routers), clients, requests_a / dt,
        (after.probes - before.probes) / dt, _diff(after, before, "canary_requests") / dt,
        (after.probe_seconds - before.probe_seconds) / dt / true_capacity * 100,
        _diff(after, before, "canary_seconds") / dt / true_capacity * 100,
        sum(budgets) if budgets else "not exported", quarantine, first, since_first,
        len(outcome.clean_quarantined), int(float(final.fleet.get("garbled", 0.0)) - garbled_before),
    ]  # fmt: skip


def _reason(err: Exception) -> str:
    text = str(err).splitlines()[0]
    return "router not ready" if "not ready" in text else text[:60]


def run(args: BenchArgs) -> list[Table]:
    sizes = QUICK_SIZES if args.quick else SIZES
    clean_s, watch_s = (QUICK_CLEAN_S, QUICK_WATCH_S) if args.quick else (CLEAN_S, WATCH_S)
    rows: list[Sequence[object]] = []
    with tempfile.TemporaryDirectory(prefix="tandem-bench-probing-") as tmp:
        for prefills, decodes in sizes:
            size = f"{prefills}x{decodes}"
            print(f"# probing {size}: etcd, fleet, {ROUTERS} routers ...", flush=True)
            procs: list[ManagedProcess] = []
            try:
                cluster = start_cluster(Path(tmp) / size, procs, prefills, decodes, ROUTERS)
                rows.append(asyncio.run(measure(cluster, size, clean_s, watch_s)))
            except (ProcessFailedError, RuntimeError) as err:  # a size the routers cannot take is a result too
                print(f"#   {size}: not measured: {str(err).splitlines()[0]}", flush=True)
                rows.append([size, ROUTERS, clients_for(decodes), *[f"not measured: {_reason(err)}"] * 11])
            finally:
                for proc in reversed(procs):
                    with contextlib.suppress(Exception):
                        proc.stop()
    return [
        Table(
            f"integrity probing as the fleet grows: {ROUTERS} routers (etcd discovery, defaults), fleet workers "
            f"(20 ms/token, {MAX_RUNNING} requests at once per decode), {clean_s:.0f} s clean, then one decode garbles",
            COLUMNS,
            rows=rows,
            notes=[
                f"targets: probing within the budget (router default {BUDGET_SHARE:.0%} of capacity), 0 clean pairs "
                f"quarantined, every pair of the garbling decode out on every router within {OUT_WITHIN_S:g} s",
                "routers: probes and request-seconds from tandem_integrity_probes_total / _probe_seconds_total over "
                "the fleet's true capacity (decodes x max running); workers "
                "saw: decode requests with canary-* ids over decodes x max running; 'not exported': a router "
                "without the budget gauges",
                "a 1 x 1 cluster's lone pair is compared with itself: canaries against its own known answer, "
                "temperature-0 shadows and confirmations re-run on the same pair",
                "first garbled answer: when the decode garbled an answer first after the switch (the race needs "
                "concurrent requests on it); quarantine after it: the time to quarantine counted from then",
            ],
            plot=Plot("bar", "size", PLOTTED, "% of capacity"),
        )
    ]
