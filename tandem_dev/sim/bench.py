"""``tandem bench sim``: Mooncake TCP KV transfer vs a plain loopback socket copy, 8 ranks per pod vs 1 rank
(``bench_ranks``), and simulated worker capacity.

Runs inside a loopback-only network namespace (``make bench``). The transfer table moves the same bytes both
ways in one run and reports the ratio; the capacity table drives real worker processes over HTTP.
"""

from __future__ import annotations

import asyncio
import random
import socket
import tempfile
import threading
import time
from collections.abc import Sequence
from pathlib import Path

import aiohttp
import numpy as np

from tandem_dev.bench import BenchArgs, Table
from tandem_dev.sim.bench_ranks import rank_transfer_table
from tandem_dev.sim.testing import SimWorker, pd_fields, start_decode, start_prefill, start_worker
from tandem_sim.model import model
from tandem_sim.pd.transfer import MooncakeTransfer

CONCURRENCY = 32


def _mooncake_gbps(total: int, chunk: int, rounds: int) -> float:
    src_engine, dst_engine = MooncakeTransfer("127.0.0.1"), MooncakeTransfer("127.0.0.1")
    src = np.full(total, 7, dtype=np.uint8)
    dst = np.zeros(total, dtype=np.uint8)
    src_engine.register(int(src.ctypes.data), total)
    dst_engine.register(int(dst.ctypes.data), total)
    offsets = list(range(0, total, chunk))
    srcs = [int(src.ctypes.data) + o for o in offsets]
    dsts = [int(dst.ctypes.data) + o for o in offsets]
    lens = [min(chunk, total - o) for o in offsets]
    target = dst_engine.session_id
    engine = src_engine.engine
    if engine.batch_transfer_sync_write(target, srcs, dsts, lens) != 0:
        raise RuntimeError("mooncake warm-up transfer failed")
    started = time.perf_counter()
    for _ in range(rounds):
        if engine.batch_transfer_sync_write(target, srcs, dsts, lens) != 0:
            raise RuntimeError("mooncake transfer failed")
    elapsed = time.perf_counter() - started
    if not np.array_equal(src, dst):
        raise RuntimeError("mooncake moved wrong bytes")
    src_engine.close()
    dst_engine.close()
    return total * rounds / elapsed / 1e9


def _socket_gbps(total: int, rounds: int) -> float:
    payload = np.full(total, 7, dtype=np.uint8).tobytes()
    server = socket.create_server(("127.0.0.1", 0))
    port = server.getsockname()[1]
    sink = bytearray(total)

    def receive() -> None:
        conn, _ = server.accept()
        view = memoryview(sink)
        with conn:
            for _ in range(rounds + 1):
                got = 0
                while got < total:
                    got += conn.recv_into(view[got:], total - got)
                conn.sendall(b"k")

    thread = threading.Thread(target=receive, daemon=True)
    thread.start()
    with socket.create_connection(("127.0.0.1", port)) as conn:
        conn.sendall(payload)
        conn.recv(1)
        started = time.perf_counter()
        for _ in range(rounds):
            conn.sendall(payload)
            conn.recv(1)
        elapsed = time.perf_counter() - started
    thread.join()
    server.close()
    return total * rounds / elapsed / 1e9


async def _drive(
    prefill: SimWorker | None, decode: SimWorker, n: int, concurrency: int, max_new: int
) -> tuple[float, int, int]:
    rng = random.Random(5)
    vocab = set(model.vocabulary())
    words = [
        w for w in ("".join(rng.choice("aeioubcdfghklmnprst") for _ in range(6)) for _ in range(4000)) if w not in vocab
    ]
    bodies: list[dict[str, object]] = [
        {"text": " ".join(rng.choice(words) for _ in range(200)), "sampling_params": {"max_new_tokens": max_new}}
        for _ in range(n)
    ]
    sem = asyncio.Semaphore(concurrency)
    counts = {"prompt": 0, "completion": 0}
    async with aiohttp.ClientSession(connector=aiohttp.TCPConnector(limit=0)) as sess:

        async def one(body: dict[str, object]) -> None:
            async with sem:
                if prefill is not None:
                    body = dict(body, **pd_fields(prefill, rng.randrange(2**63)))
                    p = sess.post(f"{prefill.url}/generate", json=body)
                    d = sess.post(f"{decode.url}/generate", json=body)
                    p_resp, d_resp = await asyncio.gather(p, d)
                    await p_resp.read()
                    out = await d_resp.json()
                else:
                    async with sess.post(f"{decode.url}/generate", json=body) as resp:
                        out = await resp.json()
                counts["prompt"] += out["meta_info"]["prompt_tokens"]
                counts["completion"] += out["meta_info"]["completion_tokens"]

        started = time.perf_counter()
        await asyncio.gather(*(one(b) for b in bodies))
        return time.perf_counter() - started, counts["prompt"], counts["completion"]


def run(args: BenchArgs) -> list[Table]:
    mb = 16 if args.quick else 128
    rounds = 3 if args.quick else 10
    total = mb * 1024 * 1024
    # At most 256 segments per batch: Mooncake's TCP transport resets connections on batches of thousands.
    chunk = max(64 * 1024, total // 256)
    moon = _mooncake_gbps(total, chunk, rounds)
    sock = _socket_gbps(total, rounds)
    transfer = Table(
        "sim: KV transfer over loopback (same bytes, same run)",
        ["path", "MB per round", "rounds", "GB/s", "vs socket"],
        [
            [f"mooncake tcp batch_transfer_sync_write ({chunk // 1024} KiB pages)", mb, rounds, moon, moon / sock],
            ["plain socket sendall/recv_into", mb, rounds, sock, 1.0],
        ],
    )
    n = 60 if args.quick else 600
    rows: list[Sequence[object]] = []
    with tempfile.TemporaryDirectory(prefix="tandem-bench-") as tmp:
        log_dir = Path(tmp)
        speed = ["--sim-inter-token-ms", "0", "--sim-prefill-ms-per-token", "0", "--max-total-tokens", "262144"]
        agg = start_worker("bench-agg", log_dir, speed)
        prefill = start_prefill("bench-prefill", log_dir, speed)
        decode = start_decode("bench-decode", log_dir, speed)
        try:
            aggregated: dict[int, float] = {}
            for label, p, d, max_new in (
                ("aggregated, prefill-heavy (200 in / 1 out)", None, agg, 1),
                ("PD pair, prefill-heavy (200 in / 1 out)", prefill, decode, 1),
                ("aggregated, decode-heavy (200 in / 64 out)", None, agg, 64),
                ("PD pair, decode-heavy (200 in / 64 out)", prefill, decode, 64),
            ):
                asyncio.run(_drive(p, d, 16, CONCURRENCY, max_new))  # warm-up: connections, caches, sessions
                elapsed, prompt, completion = asyncio.run(_drive(p, d, n, CONCURRENCY, max_new))
                rate = n / elapsed
                if p is None:
                    aggregated[max_new] = rate
                ratio = rate / aggregated[max_new]
                rows.append([label, n, rate, ratio, prompt / elapsed, completion / elapsed])
        finally:
            for w in (agg, prefill, decode):
                w.proc.stop()
    capacity = Table(
        "sim: simulated worker capacity (no simulated delays; CPU-bound on this machine)",
        ["workload", "requests", "req/s", "vs aggregated", "prompt tok/s", "output tok/s"],
        rows,
        notes=[
            f"concurrency {CONCURRENCY}; prompts of non-vocabulary words (surfaces carried in the KV); KV 256 B/token "
            "moved by Mooncake in PD rows; every process (client too) shares the machine's cores",
        ],
    )
    return [transfer, rank_transfer_table(args.quick), capacity]
