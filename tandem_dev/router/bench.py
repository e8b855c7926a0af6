"""``tandem bench router``: the router's own cost, side by side in one run.

The same *instant* PD workers (prefill answers at once, decode streams 16 SSE chunks) are reached directly,
through Tandem's router (1, 2 and 4 processes, and without integrity checks) and through SGLang's Rust gateway
``smg`` (pinned, installed by ``make peers`` into its own venv under ``~/.cache/tandem/``: tandem_dev.peers).
Throughput comes from ``wrk`` (C, with a Lua body) at 1, 8, 32 and 128 connections (a table and a plot of
throughput against concurrency), the tail at 256, 1,000 and 4,000 (``bench_tail``); CPU per request from /proc at
32; wrk's own CPU is reported to show it is not the limit. TTFT at concurrency 1 from a blocking socket client that
timestamps the first body byte. The targets
are measured interleaved, so that a change in what else the shared cores run falls on all of them alike: each
concurrency level is run for every target before the next level, and TTFT in ``TTFT_ROUNDS`` rounds, each
target in turn, starting with a different one each round (percentiles over all rounds' samples). Every
process is started here and stopped by process group. A peer that cannot run fails the section unless
``--allow-missing-peers`` (then its row says "not measured").
"""

from __future__ import annotations

import contextlib
import os
import re
import resource
import socket
import statistics
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass
from pathlib import Path

import orjson

from tandem_dev import peers
from tandem_dev.bench import NOT_MEASURED, BenchArgs, Plot, Table
from tandem_dev.procs import ManagedProcess, ProcessFailedError, free_port
from tandem_dev.router import bench_tail

BODY = {"model": "instant-model", "messages": [{"role": "user", "content": "Say hi"}], "stream": True, "max_tokens": 16}
DIRECT_BODY = {**BODY, "bootstrap_host": "127.0.0.1", "bootstrap_port": 8998, "bootstrap_room": 12345}
PATH = "/v1/chat/completions"


@dataclass
class Target:
    name: str
    url: str
    body: dict[str, object]
    proc: ManagedProcess | None = None  # the process group whose CPU time a request costs (None: direct)


COST_AT = 32  # connections of the cost table's row


@dataclass
class Result:
    cpu_us: float  # router CPU time (user + system, whole process group) per request at COST_AT, from /proc
    at32: Load
    ttft_p50_ms: float
    ttft_p99_ms: float
    curve: dict[int, float]  # req/s by connections


TANDEM = "tandem router"
NO_INTEGRITY = "tandem router --no-integrity"
TAIL_TARGETS = ("direct to decode", TANDEM, "tandem router --workers 2")  # and smg: the tail section's targets
ROUTERS: list[tuple[str, list[str]]] = [
    (TANDEM, []),
    (NO_INTEGRITY, ["--no-integrity"]),
    ("tandem router --workers 2", ["--workers", "2"]),
    ("tandem router --workers 4", ["--workers", "4"]),
]


@dataclass
class Load:
    """One wrk run."""

    rps: float
    p50_ms: float
    p99_ms: float
    errors: int  # non-2xx responses and socket errors
    total: int  # requests completed
    wrk_cpu: float  # wrk's own CPU time over the run's wall time (1.0: one core busy: wrk would be the limit)


def wrk(
    url: str,
    body: dict[str, object],
    connections: int,
    seconds: int,
    workdir: Path,
    headers: dict[str, str] | None = None,
) -> Load:
    """Run wrk (one thread) against ``url`` for ``seconds`` (``headers``: more request headers)."""
    script = workdir / "post.lua"
    extra = "".join(f'wrk.headers["{k}"] = "{v}"\n' for k, v in (headers or {}).items())
    script.write_text(
        'wrk.method = "POST"\nwrk.headers["Content-Type"] = "application/json"\n'
        f"{extra}wrk.body = [[{orjson.dumps(body).decode()}]]\n"
    )
    before = resource.getrusage(resource.RUSAGE_CHILDREN)
    started = time.monotonic()
    out = subprocess.run(
        ["wrk", "-t1", f"-c{connections}", f"-d{seconds}s", "--latency", "-s", str(script), url + PATH],
        check=True,
        capture_output=True,
        text=True,
        timeout=seconds + 30,
    ).stdout
    after = resource.getrusage(resource.RUSAGE_CHILDREN)
    cpu = (after.ru_utime - before.ru_utime) + (after.ru_stime - before.ru_stime)
    rps = float(re.search(r"Requests/sec:\s+([\d.]+)", out).group(1))  # type: ignore[union-attr]
    total = int(re.search(r"(\d+) requests in", out).group(1))  # type: ignore[union-attr]
    wall = time.monotonic() - started
    return Load(rps, _wrk_pct(out, "50%"), _wrk_pct(out, "99%"), bench_tail.errors(out), total, cpu / wall)


def _group_stats(pgid: int) -> Iterator[list[str]]:
    """The /proc/<pid>/stat fields after "(comm)" of every live process in process group ``pgid`` (Linux)."""
    for entry in Path("/proc").iterdir():
        if not entry.name.isdigit():
            continue
        try:
            fields = (entry / "stat").read_text().rsplit(")", 1)[1].split()
        except OSError:
            continue
        if int(fields[2]) == pgid:  # state ppid pgrp ...
            yield fields


def group_cpu_seconds(pgid: int) -> float:
    """User + system CPU seconds of every live process in process group ``pgid``."""
    ticks = os.sysconf("SC_CLK_TCK")
    return sum(int(f[11]) + int(f[12]) for f in _group_stats(pgid)) / ticks  # utime, stime


def _cpu_reader(target: Target) -> Callable[[], float] | None:
    """What reads ``target``'s CPU seconds so far (None for direct: the workers are not the target)."""
    proc = target.proc
    return None if proc is None else lambda: group_cpu_seconds(proc.pid)


def group_rss_mb(pgid: int) -> float:
    """Resident set of every live process in process group ``pgid`` (MB)."""
    return sum(int(f[21]) for f in _group_stats(pgid)) * os.sysconf("SC_PAGE_SIZE") / 2**20


def _wrk_pct(out: str, pct: str) -> float:
    m = re.search(rf"^\s+{re.escape(pct)}\s+([\d.]+)(us|ms|s)\s*$", out, re.M)
    if m is None:
        return float("nan")
    return float(m.group(1)) * {"us": 0.001, "ms": 1.0, "s": 1000.0}[m.group(2)]


def _percentiles(samples: list[float]) -> tuple[float, float]:
    """p50 and p99 of ``samples``."""
    samples = sorted(samples)
    return statistics.median(samples), samples[min(len(samples) - 1, int(len(samples) * 0.99))]


def ttft_samples(url: str, body: dict[str, object], n: int) -> list[float]:
    """``n`` times to first response-body byte at concurrency 1 (ms), one after the other on one kept-alive
    connection."""
    host, port = url.removeprefix("http://").split(":")
    payload = orjson.dumps(body)
    request = (
        f"POST {PATH} HTTP/1.1\r\nHost: {host}\r\nContent-Type: application/json\r\n"
        f"Content-Length: {len(payload)}\r\n\r\n"
    ).encode() + payload
    samples: list[float] = []
    with socket.create_connection((host, int(port)), timeout=10) as sock:
        sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
        for _ in range(n):
            started = time.perf_counter()
            sock.sendall(request)
            buf = b""
            first = 0.0
            while True:
                data = sock.recv(65536)
                if not data:
                    raise ConnectionError(f"{url} closed the connection")
                buf += data
                head_end = buf.find(b"\r\n\r\n")
                if not first and head_end >= 0 and len(buf) > head_end + 4:
                    first = time.perf_counter()
                if b"\r\n0\r\n\r\n" in buf or buf.endswith(b"data: [DONE]\n\n\r\n"):
                    break
            samples.append((first - started) * 1000)
    return samples


@contextlib.contextmanager
def processes(
    workdir: Path,
    allow_missing_peers: bool,
    routers: Sequence[tuple[str, list[str]]] = ROUTERS,
    decode_args: Sequence[str] = (),
) -> Iterator[tuple[list[Target], list[ManagedProcess], list[str]]]:
    """The instant workers (the decode with ``decode_args`` more), each of ``routers`` and smg in front of them."""
    procs: list[ManagedProcess] = []
    notes: list[str] = []
    py = sys.executable

    def start(name: str, argv: list[str], ready: str, expect: int = 200) -> ManagedProcess:
        proc = ManagedProcess(name, argv, workdir / f"{name}.log").start()
        procs.append(proc)
        proc.wait_http(ready, timeout=60, expect=expect)
        return proc

    try:
        p_port, d_port = free_port(), free_port()
        prefill, decode = f"http://127.0.0.1:{p_port}", f"http://127.0.0.1:{d_port}"
        worker = [py, "-m", "tandem_dev.router.instant_worker", "--no-record", "--port"]
        start("prefill", [*worker, str(p_port), "--role", "prefill"], prefill + "/health")
        start("decode", [*worker, str(d_port), "--role", "decode", *decode_args], decode + "/health")
        targets = [Target("direct to decode", decode, DIRECT_BODY)]
        router_args = [
            "--prefill",
            prefill,
            "8998",
            "--decode",
            decode,
            "--log-level",
            "warning",
            "--policy",
            "round_robin",
        ]
        for name, extra in routers:
            port = free_port()
            url = f"http://127.0.0.1:{port}"
            argv = [py, "-m", "tandem.cli", "router", "--port", str(port), *extra, *router_args]
            targets.append(Target(name, url, BODY, start(name.replace(" ", "_"), argv, url + "/readiness")))
        smg_name = f"smg {peers.smg_version()}"
        try:
            s_port = free_port()
            argv = peers.smg_argv([(prefill, 8998)], [decode], s_port, free_port())
            smg_proc = start("smg", argv, f"http://127.0.0.1:{s_port}/health")
            targets.append(Target(smg_name, f"http://127.0.0.1:{s_port}", BODY, smg_proc))
        except (peers.PeerMissingError, ProcessFailedError) as err:
            if not allow_missing_peers:
                raise peers.PeerMissingError(f"{smg_name} cannot run here: {str(err).splitlines()[0]}") from err
            targets.append(Target(smg_name, "", BODY))  # url "": not measured
            notes.append(f"{smg_name} not measured: {str(err).splitlines()[0]}")
        yield targets, procs, notes
    finally:
        for proc in reversed(procs):
            proc.stop()


def run(args: BenchArgs) -> list[Table]:
    """The router tables: its own cost on instant workers (and against concurrency), end to end on simulated
    workers, the resume gap."""
    from tandem_dev.router import bench_e2e, bench_resume

    tables = router_cost(args)
    with tempfile.TemporaryDirectory(prefix="tandem-bench-e2e-") as tmp:
        tables.append(bench_e2e.run(args, Path(tmp)))
    with tempfile.TemporaryDirectory(prefix="tandem-bench-resume-") as tmp:
        tables.append(bench_resume.run(args, Path(tmp)))
    return tables


TTFT_ROUNDS = 5


def _measure_all(
    targets: Sequence[Target], levels: Sequence[int], seconds: int, n_ttft: int, workdir: Path
) -> dict[str, Result]:
    """wrk at every concurrency in ``levels`` (CPU per request at 32), each level for every target in turn; then
    TTFT at concurrency 1 in rounds, the targets in a rotating order."""
    for t in targets:
        wrk(t.url, t.body, 8, 1, workdir)  # warm up connections and caches
    curves: dict[str, dict[int, float]] = {t.name: {} for t in targets}
    at32: dict[str, Load] = {}
    cpu: dict[str, float] = {t.name: float("nan") for t in targets}
    for connections in levels:
        for t in targets:
            cpu0 = group_cpu_seconds(t.proc.pid) if t.proc else 0.0
            load = wrk(t.url, t.body, connections, seconds, workdir)
            curves[t.name][connections] = load.rps
            if connections == COST_AT:
                at32[t.name] = load
                if t.proc:
                    cpu[t.name] = (group_cpu_seconds(t.proc.pid) - cpu0) / max(load.total, 1) * 1e6
    samples: dict[str, list[float]] = {t.name: [] for t in targets}
    per_round = max(1, n_ttft // TTFT_ROUNDS)
    for r in range(TTFT_ROUNDS):
        for t in [*targets[r % len(targets) :], *targets[: r % len(targets)]]:
            samples[t.name] += ttft_samples(t.url, t.body, per_round)
    return {t.name: Result(cpu[t.name], at32[t.name], *_percentiles(samples[t.name]), curves[t.name]) for t in targets}


def router_cost(args: BenchArgs) -> list[Table]:
    seconds = 2 if args.quick else 8
    n_ttft = 50 if args.quick else 300
    levels = (8, COST_AT) if args.quick else (1, 8, COST_AT, 128)
    peers.require("wrk")  # every row is measured with wrk
    if not args.allow_missing_peers:
        peers.require("smg")  # fail before starting anything
    load_start = os.getloadavg()
    with (
        tempfile.TemporaryDirectory(prefix="tandem-bench-router-") as tmp,
        processes(Path(tmp), args.allow_missing_peers) as (targets, _, notes),
    ):
        measured = _measure_all([t for t in targets if t.url], levels, seconds, n_ttft, Path(tmp))
        results: dict[str, Result | None] = {t.name: measured.get(t.name) for t in targets}
        tail_levels = bench_tail.QUICK_LEVELS if args.quick else bench_tail.LEVELS
        tail_targets = [t for t in targets if t.name in TAIL_TARGETS or t.name.startswith("smg")]
        tail_runs = bench_tail.measure(
            [bench_tail.TailTarget(t.name, t.url, t.body, _cpu_reader(t)) for t in tail_targets if t.url],
            PATH,
            tail_levels,
            seconds,
            1 if args.quick else bench_tail.ROUNDS,
            Path(tmp),
        )
        for t in tail_targets:
            tail_runs.setdefault(t.name, {c: [] for c in tail_levels})  # not measured
    load_end = os.getloadavg()
    direct = results["direct to decode"]
    assert direct is not None
    smg = next((r for name, r in results.items() if name.startswith("smg")), None)
    table = Table(
        "router cost: instant PD workers (prefill answers at once, decode streams 16 chunks), wrk -c32 / TTFT at c=1",
        [
            "target",
            "CPU us/req",
            "CPU vs smg",
            "req/s @32",
            "vs smg",
            "lat p50 ms",
            "lat p99 ms",
            "errors",
            "wrk CPU",
            "TTFT p50 ms",
            "TTFT p99 ms",
            "TTFT p50 over direct ms",
            "TTFT overhead vs smg",
        ],
        plot=Plot("bar", "target", ["req/s @32"], "requests/s at 32 connections"),
    )
    smg_overhead = smg.ttft_p50_ms - direct.ttft_p50_ms if smg else float("nan")
    for name, r in results.items():
        if r is None:
            table.rows.append([name, *[NOT_MEASURED] * (len(table.columns) - 1)])
            continue
        overhead = r.ttft_p50_ms - direct.ttft_p50_ms
        table.rows.append(
            [
                name,
                "-" if r is direct else r.cpu_us,
                "-" if r is direct else _ratio(r.cpu_us, smg.cpu_us if smg else None),
                r.at32.rps,
                _ratio(r.at32.rps, smg.at32.rps if smg else None),
                r.at32.p50_ms,
                r.at32.p99_ms,
                r.at32.errors,
                f"{r.at32.wrk_cpu:.0%}",
                r.ttft_p50_ms,
                r.ttft_p99_ms,
                "-" if r is direct else f"{overhead:+.3f}",
                "-" if r is direct else _ratio(overhead, smg_overhead if smg else None),
            ]
        )
    table.notes += notes
    on, off = results.get(TANDEM), results.get(NO_INTEGRITY)
    if on and off:
        table.notes.append(
            f"output-integrity checks (detectors on every response, canaries): {on.cpu_us - off.cpu_us:+.0f} us CPU "
            f"per request, throughput {on.at32.rps / off.at32.rps:.2f}x of the router without them (same run)"
        )
    table.notes += [
        "CPU us/req: the router's own CPU time (all its processes) per request at 32 connections, from /proc; "
        "unlike req/s it hardly depends on what else this shared machine runs",
        "wrk CPU: wrk's own CPU time over the run's wall time (100% = the one core its thread can use: wrk would be "
        "the limit); 'direct to decode' is the ceiling the workers allow",
        f"load average (1 min) {load_start[0]:.1f} at start, {load_end[0]:.1f} at end, on {os.cpu_count()} cores; "
        f"{seconds}s per wrk run, {n_ttft} sequential requests for TTFT ({TTFT_ROUNDS} interleaved rounds); the "
        "targets are measured interleaved and share these cores",
    ]
    curve = Table(
        "router throughput against concurrency (req/s, instant PD workers, wrk)",
        ["connections", *results],
        plot=Plot("line", "connections", [n for n, r in results.items() if r is not None], "requests/s"),
    )
    for connections in levels:
        curve.rows.append([connections, *(r.curve[connections] if r else NOT_MEASURED for r in results.values())])
    smg_name = next(name for name in results if name.startswith("smg"))
    return [table, curve, bench_tail.table(tail_runs, tail_levels, seconds, smg_name)]


def _ratio(value: float, base: float | None) -> str:
    return f"{value / base:.2f}x" if base else NOT_MEASURED
