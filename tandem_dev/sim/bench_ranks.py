"""``tandem bench sim``: KV transfer with 8 ranks per pod against 1 rank, the same bytes.

SGLang runs one Mooncake engine per GPU rank, and with equal prefill and decode TP each prefill rank writes its
shard of every token (its KV heads) into the decode rank of the same TP rank (``MooncakeKVManager.send_kvcache``).
Here a "prefill pod" and a "decode pod" of ``ranks`` engines each move the same total bytes: rank ``r`` writes its
``1/ranks`` share, in pages of the same size as the 1-rank run, from its own registered buffer into its peer's, all
ranks at once (one thread per rank, as SGLang's ranks are processes). Bytes are checked after the run.
"""

from __future__ import annotations

import time
from collections.abc import Sequence
from concurrent.futures import ThreadPoolExecutor

import numpy as np
import numpy.typing as npt

from tandem_dev.bench import Table
from tandem_sim.pd.transfer import MooncakeTransfer

MAX_SEGMENTS = 256  # Mooncake's TCP transport resets connections on batches of thousands of segments


class _RankPair:
    """One prefill rank's engine and buffer, and its decode peer's."""

    def __init__(self, nbytes: int, fill: int) -> None:
        self.src_engine, self.dst_engine = MooncakeTransfer("127.0.0.1"), MooncakeTransfer("127.0.0.1")
        self.src: npt.NDArray[np.uint8] = np.full(nbytes, fill, dtype=np.uint8)
        self.dst: npt.NDArray[np.uint8] = np.zeros(nbytes, dtype=np.uint8)
        self.src_engine.register(int(self.src.ctypes.data), nbytes)
        self.dst_engine.register(int(self.dst.ctypes.data), nbytes)

    def batches(self, page: int) -> list[tuple[list[int], list[int], list[int]]]:
        offsets = list(range(0, len(self.src), page))
        src, dst = int(self.src.ctypes.data), int(self.dst.ctypes.data)
        lengths = [min(page, len(self.src) - o) for o in offsets]
        return [
            (
                [src + o for o in offsets[i : i + MAX_SEGMENTS]],
                [dst + o for o in offsets[i : i + MAX_SEGMENTS]],
                lengths[i : i + MAX_SEGMENTS],
            )
            for i in range(0, len(offsets), MAX_SEGMENTS)
        ]

    def move(self, page: int, rounds: int) -> None:
        engine, target = self.src_engine.engine, self.dst_engine.session_id
        batches = self.batches(page)
        for _ in range(rounds):
            for src, dst, lengths in batches:
                if engine.batch_transfer_sync_write(target, src, dst, lengths) != 0:
                    raise RuntimeError(f"mooncake transfer to {target} failed")

    def close(self) -> None:
        self.src_engine.close()
        self.dst_engine.close()


def _gbps(total: int, ranks: int, page: int, rounds: int) -> float:
    pairs = [_RankPair(total // ranks, 1 + r) for r in range(ranks)]
    try:
        with ThreadPoolExecutor(max_workers=ranks) as pool:
            list(pool.map(lambda p: p.move(page, 1), pairs))  # warm-up: connections, segment handles
            started = time.perf_counter()
            list(pool.map(lambda p: p.move(page, rounds), pairs))
            elapsed = time.perf_counter() - started
        if not all(np.array_equal(p.src, p.dst) for p in pairs):
            raise RuntimeError("mooncake moved wrong bytes")
    finally:
        for pair in pairs:
            pair.close()
    return total * rounds / elapsed / 1e9


def rank_transfer_table(quick: bool) -> Table:
    mb = 16 if quick else 128
    rounds = 3 if quick else 10
    total = mb * 1024 * 1024
    page = 64 * 1024
    rows: list[Sequence[object]] = []
    base = 0.0
    for ranks in (1, 8):
        gbps = _gbps(total, ranks, page, rounds)
        base = base or gbps
        rows.append([ranks, ranks, mb, mb / ranks, rounds, gbps, gbps / base])
    return Table(
        "sim: KV transfer, 8 ranks per pod vs 1 rank (same bytes, same run)",
        ["ranks per pod", "engines per pod", "MB per round", "MB per rank", "rounds", "GB/s", "vs 1 rank"],
        rows,
        notes=[
            f"Mooncake TCP over loopback, {page // 1024} KiB pages, one batch_transfer_sync_write of <= "
            f"{MAX_SEGMENTS} pages at a time per rank; 8 ranks = 8 engine pairs (8 sessions) in parallel threads",
            "on GPUs each rank has its own NIC path (RDMA); here every engine shares the machine's cores",
        ],
    )
