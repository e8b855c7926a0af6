"""Thin adapter over the Mooncake transfer engine (``mooncake-transfer-engine-non-cuda``), as SGLang PD uses it.

``P2PHANDSHAKE`` metadata and the ``tcp`` protocol; the session id of a process is ``ip:rpc_port``, the RPC port
chosen by Mooncake from ``MC_MIN_RPC_PORT``..``MC_MAX_RPC_PORT``. A restarted process may come back under its old
session id when that range is narrow (a pod's window); peers then still hold the dead process's descriptor and
connections under it (simulator/README.md). Blocking calls run in worker threads so the event loop keeps serving.

Writes go through **one** writer thread, and the writes queued for the same peer while a batch is on the wire
are coalesced into the next ``batch_transfer_sync_write`` call (SGLang's transfer queue does the same per
destination session). Measured on loopback TCP: concurrent sync writes from several threads contend inside the
engine (4 threads move ~3x fewer transfers per second than one), so one writer thread that batches is fastest.
A failed batch fails every room in it, as a dead peer would.

One ``MooncakeTransfer`` is one GPU rank's engine (SGLang's ``MooncakeTransferEngine`` in
``sglang/srt/distributed/device_communicators/mooncake_transfer_engine.py``): a pod with 8 ranks has 8, each with its
own RPC port and session id. Mooncake reads ``MC_MIN_RPC_PORT``/``MC_MAX_RPC_PORT`` once, when ``mooncake.engine``
is first imported (measured), so the import is deferred until the first engine is made and ``main`` can set the
range first.
"""

from __future__ import annotations

import asyncio
from collections.abc import Sequence
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass

# SGLang's message when ``TransferEngine.initialize`` fails (``MooncakeTransferEngine.initialize``).
INIT_FAILED = "Mooncake Transfer Engine initialization failed."


class TransferEngineError(RuntimeError):
    pass


@dataclass
class _PendingWrite:
    session: str
    src: Sequence[int]
    dst: Sequence[int]
    lengths: Sequence[int]
    done: asyncio.Future[int]


class MooncakeTransfer:
    def __init__(self, hostname: str) -> None:
        from mooncake.engine import TransferEngine  # deferred: Mooncake reads its port range at import

        self.engine = TransferEngine()
        rc = self.engine.initialize(hostname, "P2PHANDSHAKE", "tcp", "")
        if rc != 0:
            raise TransferEngineError(INIT_FAILED)
        self.hostname = hostname
        self.rpc_port = int(self.engine.get_rpc_port())
        self._writer = ThreadPoolExecutor(max_workers=1, thread_name_prefix="mooncake-write")
        self._prober = ThreadPoolExecutor(max_workers=1, thread_name_prefix="mooncake-probe")
        self._pending: list[_PendingWrite] = []
        self._draining = False
        self._drainer: asyncio.Task[None] | None = None

    @property
    def session_id(self) -> str:
        return f"{self.hostname}:{self.rpc_port}"

    def register(self, address: int, length: int) -> None:
        rc = self.engine.register_memory(address, length)
        if rc != 0:
            raise TransferEngineError(f"register_memory({address:#x}, {length}) returned {rc}")

    def _write(self, session: str, src: list[int], dst: list[int], lengths: list[int]) -> int:
        return int(self.engine.batch_transfer_sync_write(session, src, dst, lengths))

    async def write(self, session: str, src: Sequence[int], dst: Sequence[int], lengths: Sequence[int]) -> int:
        """batch_transfer_sync_write (coalesced per peer): 0 on success, negative on failure (never raises)."""
        loop = asyncio.get_running_loop()
        pending = _PendingWrite(session, src, dst, lengths, loop.create_future())
        self._pending.append(pending)
        if not self._draining:
            self._draining = True
            self._drainer = loop.create_task(self._drain())
        return await asyncio.shield(pending.done)

    async def _drain(self) -> None:
        loop = asyncio.get_running_loop()
        try:
            while self._pending:
                batch, self._pending = self._pending, []
                by_session: dict[str, list[_PendingWrite]] = {}
                for pending in batch:
                    by_session.setdefault(pending.session, []).append(pending)
                for session, writes in by_session.items():
                    src = [a for w in writes for a in w.src]
                    dst = [a for w in writes for a in w.dst]
                    lengths = [n for w in writes for n in w.lengths]
                    try:
                        rc = await loop.run_in_executor(self._writer, self._write, session, src, dst, lengths)
                    except RuntimeError:  # the executor was shut down: the process is stopping
                        rc = -1
                    for w in writes:
                        if not w.done.done():
                            w.done.set_result(rc)
        finally:
            self._draining = False

    async def read(self, session: str, local: Sequence[int], remote: Sequence[int], lengths: Sequence[int]) -> int:
        """batch_transfer_sync_read (a peer pulling weights from a seed): 0 on success, negative on failure."""
        loop = asyncio.get_running_loop()
        call = self.engine.batch_transfer_sync_read
        return int(await loop.run_in_executor(self._prober, call, session, list(local), list(remote), list(lengths)))

    async def probe(self, session: str) -> int:
        loop = asyncio.get_running_loop()
        return int(await loop.run_in_executor(self._prober, self.engine.send_probe, session))

    def close(self) -> None:
        self._writer.shutdown(wait=False, cancel_futures=True)
        self._prober.shutdown(wait=False, cancel_futures=True)
