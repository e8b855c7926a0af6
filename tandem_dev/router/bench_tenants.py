"""``tandem bench tenants``: tenant flow control (issue 36), side by side in one run.

Two simulated prefills and two decodes (each decode runs at most ``DECODE_SLOTS`` requests at once) behind two
routers with ``--client-id-header X-Tenant``: the default (flow control on, no limits file) and
``--no-flow-control``, measured in turn on the same workers, rounds interleaved (each round starts with the other):

- **quiet tenants' TTFT**: ``QUIET`` tenants send ``QUIET_STREAMS`` streams each back to back (an aiohttp client,
  TTFT at the first chunk), first alone, then while one more tenant floods with ``FLOOD`` streams (``wrk``, 10x the
  quiet tenants' load together); the flood starts ``WARMUP_S`` before the quiet tenants are measured.
- **the machine's share**: once a round, the quiet tenants on the default router while the same flood goes to a
  second, separate set of workers and router. Nothing is shared with the flood but the machine's cores, so this is
  the quiet tenants' TTFT under the flood's CPU load alone: the best any admission policy could give them here.
- **the flood alone**: its throughput (``wrk``) on the idle cluster, with and without flow control: ``SOLO_PAIRS``
  pairs of short runs, one router right after the other (the order alternating), judged by the median of the
  pairs' ratios, so that the machine's load, which moves between runs, moves both sides of a ratio alike.
- **router CPU per request**: ``tandem bench router``'s method (instant PD workers, ``wrk -c32``, /proc CPU time of
  the router's process group) with and without flow control.

Every phase starts on idle workers (``wait_idle``: the decodes' backlog is over), so a flood's backlog left
in the workers (without flow control its 80 requests sit in the decodes' queues) does not fall into the next
phase. The quiet client reports its own CPU use and event-loop lag, to show it is not the limit.
"""

from __future__ import annotations

import asyncio
import contextlib
import os
import sys
import tempfile
import time
import urllib.request
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path

import aiohttp

from tandem_dev import peers
from tandem_dev.bench import BenchArgs, Plot, Table
from tandem_dev.procs import ManagedProcess, free_port
from tandem_dev.router.bench import group_cpu_seconds, wrk

HOST = "127.0.0.1"
MODEL = "tandem/sim-model"
DECODE_SLOTS = 8
QUIET, QUIET_STREAMS = 4, 2
FLOOD = 10 * QUIET * QUIET_STREAMS
WARMUP_S = 3
SOLO_PAIRS, SOLO_S = 6, 5  # the flood alone: pairs of runs (on, off / off, on), seconds each
IDLE_TIMEOUT_S = 60
PATH = "/v1/chat/completions"
PROMPT = [{"role": "user", "content": "tell me about prefill and decode"}]
BODY: dict[str, object] = {"model": MODEL, "messages": PROMPT, "max_tokens": 16, "temperature": 0, "stream": True}
ON, OFF = "flow control (default)", "--no-flow-control"
MACHINE = "the machine's share: the flood on other workers"


@dataclass
class Quiet:
    ttft_ms: list[float] = field(default_factory=list)
    errors: int = 0
    cpu_share: float = 0.0  # the client's CPU time over the wall time
    lag_ms: float = 0.0  # the client's worst event-loop lag


def pct(values: list[float], q: float) -> float:
    s = sorted(values)
    return s[min(len(s) - 1, int(len(s) * q))] if s else float("nan")


async def quiet_ttft(router: str, seconds: float) -> Quiet:
    out = Quiet()
    stop_at = time.monotonic() + seconds

    async def stream(http: aiohttp.ClientSession, tenant: str) -> None:
        while time.monotonic() < stop_at:
            started = time.perf_counter()
            try:
                async with http.post(router + PATH, json=BODY, headers={"X-Tenant": tenant}) as resp:
                    first = 0.0
                    async for chunk in resp.content.iter_any():
                        if not first and chunk:
                            first = time.perf_counter()
                    if resp.status != 200:
                        out.errors += 1
                        continue
                out.ttft_ms.append((first - started) * 1000)
            except (aiohttp.ClientError, TimeoutError):
                out.errors += 1

    async def lag() -> None:
        while time.monotonic() < stop_at:
            before = time.perf_counter()
            await asyncio.sleep(0.01)
            out.lag_ms = max(out.lag_ms, (time.perf_counter() - before - 0.01) * 1000)

    cpu0, wall0 = time.process_time(), time.monotonic()
    async with aiohttp.ClientSession(timeout=aiohttp.ClientTimeout(total=120)) as http:
        await asyncio.gather(lag(), *(stream(http, f"quiet-{t}") for t in range(QUIET) for _ in range(QUIET_STREAMS)))
    out.cpu_share = (time.process_time() - cpu0) / (time.monotonic() - wall0)
    return out


async def quiet_under_flood(
    router: str, seconds: float, workdir: Path, flood_at: str | None = None
) -> tuple[Quiet, float]:
    """The quiet tenants measured on ``router`` while wrk floods as tenant ``flood`` (on ``flood_at``, by default
    the same router); returns them and the flood's req/s."""
    flood = asyncio.create_task(
        asyncio.to_thread(
            wrk, flood_at or router, BODY, FLOOD, int(seconds + WARMUP_S + 1), workdir, {"X-Tenant": "flood"}
        )
    )
    await asyncio.sleep(WARMUP_S)
    quiet = await quiet_ttft(router, seconds)
    return quiet, (await flood).rps


def wait_idle(decodes: list[str], timeout_s: float = IDLE_TIMEOUT_S) -> None:
    """Until the decodes' backlog is over (their ``--enable-metrics`` gauges): nothing queued and the running count
    no longer falling over 0.5 s. Not until nothing runs: a simulated decode may keep a request of a client that
    went away counted running for good (seen: 2, with its KV cache 99.8 % full). At most ``timeout_s``."""
    deadline = time.monotonic() + timeout_s
    last: float | None = None
    while time.monotonic() < deadline:
        running = queued = 0.0
        for url in decodes:
            with urllib.request.urlopen(url + "/metrics", timeout=5) as resp:
                for line in resp.read().decode().splitlines():
                    if line.startswith("sglang:num_running_reqs"):
                        running += float(line.rsplit(" ", 1)[1])
                    elif line.startswith("sglang:num_queue_reqs"):
                        queued += float(line.rsplit(" ", 1)[1])
        if queued == 0 and (running == 0 or running == last):
            return
        last = running if queued == 0 else None
        time.sleep(0.5)


@contextlib.contextmanager
def stack(
    workdir: Path, *, instant: bool, decodes: list[str] | None = None, targets: tuple[str, ...] = (ON, OFF)
) -> Iterator[dict[str, tuple[str, ManagedProcess]]]:
    """Workers and a router per target (``ON``, ``OFF``): ``{target: (url, router process)}``; ``decodes`` gets the
    decodes' URLs."""
    py = sys.executable
    workdir.mkdir(parents=True, exist_ok=True)
    procs: list[ManagedProcess] = []
    try:
        prefills: list[tuple[str, str]] = []
        decodes = [] if decodes is None else decodes
        for n in range(1 if instant else 2):
            port = free_port()
            if instant:
                d_port = free_port()
                argv = [py, "-m", "tandem_dev.router.instant_worker", "--no-record", "--port"]
                procs.append(ManagedProcess("prefill", [*argv, str(port), "--role", "prefill"],
                                            workdir / "prefill.log").start())  # fmt: skip
                procs.append(ManagedProcess("decode", [*argv, str(d_port), "--role", "decode"],
                                            workdir / "decode.log").start())  # fmt: skip
                prefills.append((f"http://{HOST}:{port}", "8998"))
                decodes.append(f"http://{HOST}:{d_port}")
                continue
            bport = free_port()
            sim = [py, "-m", "tandem.cli", "sim", "--model-path", MODEL, "--host", HOST, "--enable-metrics", "--port"]
            procs.append(ManagedProcess(f"prefill-{n}", [*sim, str(port), "--disaggregation-mode", "prefill",
                                        "--disaggregation-bootstrap-port", str(bport)],
                                        workdir / f"prefill-{n}.log").start())  # fmt: skip
            prefills.append((f"http://{HOST}:{port}", str(bport)))
        if not instant:
            for n in range(2):
                port = free_port()
                procs.append(ManagedProcess(f"decode-{n}", [*sim, str(port), "--disaggregation-mode", "decode",
                                            "--max-running-requests", str(DECODE_SLOTS)],
                                            workdir / f"decode-{n}.log").start())  # fmt: skip
                decodes.append(f"http://{HOST}:{port}")
        for proc, url in zip(procs, [u for u, _ in prefills] + decodes, strict=False):
            proc.wait_http(url + "/health", timeout=120)
        routers: dict[str, tuple[str, ManagedProcess]] = {}
        for name in targets:
            extra = ["--no-flow-control"] if name == OFF else []
            port = free_port()
            argv = [py, "-m", "tandem.cli", "router", "--port", str(port), "--log-level", "warning",
                    "--client-id-header", "X-Tenant", *extra]  # fmt: skip
            for url, bootstrap in prefills:
                argv += ["--prefill", url, bootstrap]
            for url in decodes:
                argv += ["--decode", url]
            if instant:
                argv += ["--policy", "round_robin"]
            proc = ManagedProcess(f"router-{len(routers)}", argv, workdir / f"router-{len(routers)}.log").start()
            procs.append(proc)
            proc.wait_http(f"http://{HOST}:{port}/readiness", timeout=60)
            routers[name] = (f"http://{HOST}:{port}", proc)
        yield routers
    finally:
        for proc in reversed(procs):
            proc.stop()


def _order(r: int) -> tuple[str, str]:
    return (ON, OFF) if r % 2 == 0 else (OFF, ON)


def run(args: BenchArgs) -> list[Table]:
    peers.require("wrk")
    rounds = 1 if args.quick else 2
    seconds = 4 if args.quick else 10
    load_start = os.getloadavg()
    alone: dict[str, Quiet] = {ON: Quiet(), OFF: Quiet()}
    flooded: dict[str, Quiet] = {ON: Quiet(), OFF: Quiet(), MACHINE: Quiet()}
    flood_rps: dict[str, list[float]] = {ON: [], OFF: [], MACHINE: []}
    solo: dict[str, list[float]] = {ON: [], OFF: []}
    cpu: dict[str, list[float]] = {ON: [], OFF: []}
    decodes: list[str] = []
    others: list[str] = []
    with tempfile.TemporaryDirectory(prefix="tandem-bench-tenants-") as tmp:
        workdir = Path(tmp)
        with (
            stack(workdir, instant=False, decodes=decodes) as routers,
            stack(workdir / "elsewhere", instant=False, decodes=others, targets=(ON,)) as elsewhere,
            asyncio.Runner() as runner,
        ):
            for url, _ in (*routers.values(), *elsewhere.values()):
                wrk(url, BODY, FLOOD, 2, workdir)  # warm up; the routers learn the decodes' capacity
                wait_idle(decodes + others)
            for r in range(rounds):
                for n, name in enumerate(_order(r)):
                    url = routers[name][0]
                    _merge(alone[name], runner.run(quiet_ttft(url, seconds)))
                    wait_idle(decodes)
                    q, rps = runner.run(quiet_under_flood(url, seconds, workdir))
                    _merge(flooded[name], q)
                    flood_rps[name].append(rps)
                    wait_idle(decodes)
                    if n == 0:  # between the two routers' phases
                        q, rps = runner.run(quiet_under_flood(routers[ON][0], seconds, workdir, elsewhere[ON][0]))
                        _merge(flooded[MACHINE], q)
                        flood_rps[MACHINE].append(rps)
                        wait_idle(others)
            for r in range(1 if args.quick else SOLO_PAIRS):
                for name in _order(r):
                    solo[name].append(wrk(routers[name][0], BODY, FLOOD, SOLO_S, workdir, {"X-Tenant": "flood"}).rps)
                    wait_idle(decodes)
        with stack(workdir, instant=True) as routers:
            body = {**BODY, "model": "instant-model"}
            for url, _ in routers.values():
                wrk(url, body, 8, 1, workdir)
            for r in range(rounds * 2):
                for name in _order(r):
                    url, proc = routers[name]
                    cpu0 = group_cpu_seconds(proc.pid)
                    load = wrk(url, body, 32, 2 if args.quick else 6, workdir)
                    cpu[name].append((group_cpu_seconds(proc.pid) - cpu0) / max(load.total, 1) * 1e6)
    return _tables(alone, flooded, flood_rps, solo, cpu, load_start, seconds, rounds)


def _merge(into: Quiet, q: Quiet) -> None:
    into.ttft_ms += q.ttft_ms
    into.errors += q.errors
    into.cpu_share = max(into.cpu_share, q.cpu_share)
    into.lag_ms = max(into.lag_ms, q.lag_ms)


def _mean(values: list[float]) -> float:
    return sum(values) / len(values) if values else float("nan")


def _tables(
    alone: dict[str, Quiet],
    flooded: dict[str, Quiet],
    flood_rps: dict[str, list[float]],
    solo: dict[str, list[float]],
    cpu: dict[str, list[float]],
    load_start: tuple[float, float, float],
    seconds: int,
    rounds: int,
) -> list[Table]:
    ttft = Table(
        f"quiet tenants' TTFT: {QUIET} tenants x {QUIET_STREAMS} streams, alone and beside a tenant flooding with "
        f"{FLOOD} streams (2 prefill + 2 decode sims, {DECODE_SLOTS} requests at once per decode)",
        [
            "router",
            "p50 alone ms",
            "p99 alone ms",
            "p50 flooded ms",
            "p99 flooded ms",
            "p99 flooded / alone",
            "p99 flooded / machine's share",
            "quiet requests",
            "quiet errors",
            "flood req/s",
            "client CPU",
            "client loop lag ms",
        ],
        plot=Plot("bar", "router", ["p99 alone ms", "p99 flooded ms"], "quiet tenants' TTFT p99 (ms)"),
    )
    p99m = pct(flooded[MACHINE].ttft_ms, 0.99)
    for name in (ON, OFF, MACHINE):
        a, f = alone[ON if name == MACHINE else name], flooded[name]
        p99a, p99f = pct(a.ttft_ms, 0.99), pct(f.ttft_ms, 0.99)
        ttft.rows.append([name, pct(a.ttft_ms, 0.5), p99a, pct(f.ttft_ms, 0.5), p99f, f"{p99f / p99a:.2f}x",
                          f"{p99f / p99m:.2f}x", len(f.ttft_ms) + (0 if name == MACHINE else len(a.ttft_ms)),
                          f.errors + (0 if name == MACHINE else a.errors), _mean(flood_rps[name]),
                          f"{max(a.cpu_share, f.cpu_share):.0%}", max(a.lag_ms, f.lag_ms)])  # fmt: skip
    ttft.notes += [
        f"{rounds} interleaved round(s) of {seconds}s per phase; the flood (wrk, tenant 'flood') starts {WARMUP_S}s "
        "before the quiet tenants are measured; target: p99 flooded / alone <= 1.5x with flow control",
        "the machine's share: the quiet tenants on the default router (alone columns: its) while the same flood goes "
        "to a second set of 2 + 2 simulated workers behind a router of its own, once a round between the two routers' "
        "phases: the TTFT the flood's CPU load alone leaves them on this machine, which no admission policy can beat",
        "client CPU / loop lag: the quiet tenants' aiohttp client (its CPU time over wall time, its worst event-loop "
        "delay): far from a full core, so the client is not what the TTFT measures",
        f"load average (1 min) {load_start[0]:.1f} at start, {os.getloadavg()[0]:.1f} at end, {os.cpu_count()} cores",
    ]
    on, off = _mean(solo[ON]), _mean(solo[OFF])
    ratios = sorted(a / b for a, b in zip(solo[ON], solo[OFF], strict=True))
    cpu_on, cpu_off = _mean(cpu[ON]), _mean(cpu[OFF])
    cost = Table(
        "flow control's cost: the flooding tenant alone on the idle cluster (wrk), router CPU per request (instant "
        "workers, wrk -c32, as `tandem bench router`)",
        ["router", f"flood alone req/s (wrk -c{FLOOD})", "vs --no-flow-control", "CPU us/req", "vs --no-flow-control"],
    )
    cost.rows.append([ON, on, f"{pct(ratios, 0.5):.2f}x", cpu_on, f"{cpu_on / cpu_off:.2f}x"])
    cost.rows.append([OFF, off, "1.00x", cpu_off, "1.00x"])
    cost.notes += [
        "targets: flood alone >= 0.95x, CPU per request <= 1.10x of the router without flow control",
        f"flood alone: {len(ratios)} pairs of {SOLO_S}s wrk runs, one router right after the other (order "
        f"alternating); the ratio is the median of the pairs' ratios (min-max {ratios[0]:.2f}-{ratios[-1]:.2f}x; "
        f"the means' ratio {on / off:.2f}x)",
        f"per round: flood req/s on {[round(x) for x in solo[ON]]}, off {[round(x) for x in solo[OFF]]}; CPU us/req "
        f"on {[round(x) for x in cpu[ON]]}, off {[round(x) for x in cpu[OFF]]}",
    ]
    return [ttft, cost]
