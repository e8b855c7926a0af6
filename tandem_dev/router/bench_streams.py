"""``tandem bench streams``: long streams held open at once through the router (issue #42), against smg.

The instant decode paces its chunks (``--chunk-interval-s``: chunk i leaves at start + i x interval), and a client
on uvloop opens every stream at once, then timestamps each chunk's arrival. Per target (the decode directly,
``tandem router`` at its defaults, smg): the gaps between a stream's chunks (p50 and p99, against the worker's own
pacing: what the router adds is its row minus the direct row), the streams that broke, the router's CPU time per
relayed chunk (its whole process group, from /proc) and its memory per open stream (resident set with every stream
open, minus before, over the streams).

The machine bounds the scale: the workers, the client and the router share 2 cores and 20,000 file descriptors
(one stream holds a client socket and a worker socket in the router, and one in each of the client and the
worker), so the full run holds 2,000 streams of 30 chunks 0.5 s apart (4,000 chunks a second); a K2.6 decode's
500 tokens at 30 ms times 2,000 streams is 67,000 chunks a second, past what one Python client can read here.
"""

from __future__ import annotations

import asyncio
import statistics
import tempfile
import time
from dataclasses import dataclass, field
from pathlib import Path

import orjson
import uvloop

from tandem_dev.bench import NOT_MEASURED, BenchArgs, Table
from tandem_dev.router import bench

STREAMS, CHUNKS, INTERVAL_S = 2000, 30, 0.5
QUICK = (100, 10, 0.2)


@dataclass
class _Tally:
    gaps_ms: list[float] = field(default_factory=list)  # between consecutive chunks of a stream, all streams
    first_ms: list[float] = field(default_factory=list)  # request sent to first chunk
    broken: int = 0  # streams that ended before their last chunk, or failed
    open: int = 0  # streams open now


async def _one(host: str, port: int, request: bytes, chunks: int, out: _Tally) -> None:
    reader, writer = await asyncio.open_connection(host, port)
    try:
        sent = time.perf_counter()
        writer.write(request)
        seen, last = 0, 0.0
        out.open += 1
        while True:
            data = await reader.read(65536)
            if not data:
                break
            now = time.perf_counter()
            count = data.count(b"data: {")
            if count:
                if seen == 0:
                    out.first_ms.append((now - sent) * 1000)
                else:
                    out.gaps_ms.append((now - last) * 1000)
                out.gaps_ms.extend([0.0] * (count - 1))  # arrived together
                seen, last = seen + count, now
            if b"data: [DONE]" in data:
                break
        if seen < chunks:
            out.broken += 1
    except OSError:
        out.broken += 1
    finally:
        out.open -= 1
        writer.close()


def _request(url: str, body: dict[str, object]) -> tuple[str, int, bytes]:
    host, port = url.removeprefix("http://").split(":")
    payload = orjson.dumps(body)
    head = (
        f"POST {bench.PATH} HTTP/1.1\r\nHost: {host}\r\nContent-Type: application/json\r\nConnection: close\r\n"
        f"Content-Length: {len(payload)}\r\n\r\n"
    )
    return host, int(port), head.encode() + payload


def measure(target: bench.Target, streams: int, chunks: int, interval_s: float) -> dict[str, float | int]:
    """Open ``streams`` streams at once through ``target``; the figures of the module docstring."""
    host, port, request = _request(target.url, {**target.body, "max_tokens": chunks})
    out = _Tally()
    pgid = target.proc.pid if target.proc else None
    rss0 = _rss_mb(pgid)
    cpu0 = bench.group_cpu_seconds(pgid) if pgid else 0.0
    peak_rss = rss0

    async def run() -> None:
        nonlocal peak_rss
        tasks = [asyncio.create_task(_one(host, port, request, chunks, out)) for _ in range(streams)]
        until = time.monotonic() + chunks * interval_s * 3 + 60
        while not all(t.done() for t in tasks) and time.monotonic() < until:
            await asyncio.sleep(interval_s)
            if out.open >= streams * 0.95:
                peak_rss = max(peak_rss, _rss_mb(pgid))
        for t in tasks:
            t.cancel()
        await asyncio.gather(*tasks, return_exceptions=True)

    with asyncio.Runner(loop_factory=uvloop.new_event_loop) as runner:
        runner.run(run())
    cpu = (bench.group_cpu_seconds(pgid) - cpu0) if pgid else float("nan")
    relayed = (streams - out.broken) * chunks
    return {
        "gap p50 ms": statistics.median(out.gaps_ms) if out.gaps_ms else float("nan"),
        "gap p99 ms": _pct(out.gaps_ms, 0.99),
        "first chunk p99 ms": _pct(out.first_ms, 0.99),
        "broken": out.broken,
        "CPU us/chunk": cpu / max(relayed, 1) * 1e6 if pgid else float("nan"),
        "KB/stream": (peak_rss - rss0) * 1024 / streams if pgid else float("nan"),
    }


def _pct(values: list[float], q: float) -> float:
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, int(len(ordered) * q))] if ordered else float("nan")


def _rss_mb(pgid: int | None) -> float:
    return 0.0 if pgid is None else bench.group_rss_mb(pgid)


def run(args: BenchArgs) -> list[Table]:
    streams, chunks, interval = QUICK if args.quick else (STREAMS, CHUNKS, INTERVAL_S)
    routers: list[tuple[str, list[str]]] = [(bench.TANDEM, [])]
    decode_args = ["--chunks", str(chunks), "--chunk-interval-s", str(interval)]
    with (
        tempfile.TemporaryDirectory(prefix="tandem-bench-streams-") as tmp,
        bench.processes(Path(tmp), args.allow_missing_peers, routers, decode_args) as (targets, _, notes),
    ):
        rows = {t.name: measure(t, streams, chunks, interval) if t.url else None for t in targets}
    columns = ["gap p50 ms", "gap p99 ms", "first chunk p99 ms", "broken", "CPU us/chunk", "KB/stream"]
    table = Table(
        f"long streams: {streams} open at once, {chunks} chunks {interval * 1000:g} ms apart (instant decode)",
        ["target", *columns],
    )
    for name, row in rows.items():
        table.rows.append(
            [name, *(NOT_MEASURED if row is None else "-" if row[c] != row[c] else row[c] for c in columns)]
        )
    table.notes += [
        *notes,
        f"gap: time between two chunks of a stream at the client; the worker paces them {interval * 1000:g} ms apart, "
        "so a router's added delay is its gap minus the direct row's",
        "CPU us/chunk: the router's process group CPU time over the run per chunk relayed; KB/stream: its resident "
        "set with 95% of the streams open, minus before, per stream",
        "scale bound by this machine (2 cores, 20,000 file descriptors): see tandem_dev/router/bench_streams.py",
    ]
    return [table]
