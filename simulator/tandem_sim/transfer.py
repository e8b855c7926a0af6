"""Thin adapter over the Mooncake transfer engine (``mooncake-transfer-engine-non-cuda``), as SGLang PD uses it.

``P2PHANDSHAKE`` metadata and the ``tcp`` protocol; the session id of a process is ``ip:rpc_port`` (the RPC port
is chosen by Mooncake, so a restarted process gets a new session id). Blocking calls run in a worker thread so
the event loop keeps serving.
"""

from __future__ import annotations

import asyncio
import threading
from collections.abc import Sequence
from concurrent.futures import ThreadPoolExecutor

from mooncake.engine import TransferEngine


class TransferEngineError(RuntimeError):
    pass


class MooncakeTransfer:
    def __init__(self, hostname: str, workers: int = 4) -> None:
        self.engine = TransferEngine()
        rc = self.engine.initialize(hostname, "P2PHANDSHAKE", "tcp", "")
        if rc != 0:
            raise TransferEngineError(f"TransferEngine.initialize({hostname!r}, P2PHANDSHAKE, tcp) returned {rc}")
        self.hostname = hostname
        self.rpc_port = int(self.engine.get_rpc_port())
        self._executor = ThreadPoolExecutor(max_workers=workers, thread_name_prefix="mooncake")
        self._lock = threading.Lock()

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
        """batch_transfer_sync_write in a worker thread: 0 on success, negative on failure (never raises)."""
        loop = asyncio.get_running_loop()
        return await loop.run_in_executor(self._executor, self._write, session, list(src), list(dst), list(lengths))

    async def probe(self, session: str) -> int:
        loop = asyncio.get_running_loop()
        return int(await loop.run_in_executor(self._executor, self.engine.send_probe, session))

    def close(self) -> None:
        self._executor.shutdown(wait=False, cancel_futures=True)
