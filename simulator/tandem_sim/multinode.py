"""Multi-node groups (``--nnodes N --node-rank i --dist-init-addr host:port``), as SGLang's NCCL group behaves.

Rank 0 listens on ``--dist-init-addr`` and is not ready until ranks 1..N-1 have connected; ranks > 0 connect
(retrying until rank 0 is up) and serve only the dummy health server on ``--port`` (SGLang's
``launch_dummy_health_check_server``). The group lives as long as every rank does: when a connection drops,
the other side exits, like a NCCL group that loses a rank.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging

log = logging.getLogger("tandem_sim.multinode")
HELLO = b"tandem-sim-rank "


def split_addr(addr: str) -> tuple[str, int]:
    host, _, port = addr.rpartition(":")
    if not host or not port.isdigit():
        raise ValueError(f"--dist-init-addr must be host:port, got {addr!r}")
    return host.strip("[]"), int(port)


class Rendezvous:
    def __init__(self, nnodes: int, node_rank: int, dist_init_addr: str) -> None:
        self.nnodes = nnodes
        self.node_rank = node_rank
        self.host, self.port = split_addr(dist_init_addr)
        self.connected: set[int] = set()
        self.all_connected = asyncio.Event()
        self.lost = asyncio.Event()
        self._server: asyncio.Server | None = None
        self._tasks: set[asyncio.Task[None]] = set()  # the loop only keeps weak references to tasks

    async def start(self) -> None:
        if self.node_rank == 0:
            self._server = await asyncio.start_server(self._on_peer, self.host, self.port)
            if self.nnodes == 1:
                self.all_connected.set()
        else:
            self._tasks.add(asyncio.get_running_loop().create_task(self._connect()))

    async def _on_peer(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        current = asyncio.current_task()
        if current is not None:
            self._tasks.add(current)
        try:
            line = await reader.readline()
            if not line.startswith(HELLO):
                writer.close()
                return
            rank = int(line[len(HELLO) :])
        except (ValueError, ConnectionError):
            writer.close()
            return
        self.connected.add(rank)
        log.info("rank connected", extra={"rank": rank, "connected": len(self.connected) + 1, "nnodes": self.nnodes})
        if len(self.connected) >= self.nnodes - 1:
            self.all_connected.set()
        with contextlib.suppress(ConnectionError):
            await reader.read()  # returns at EOF: the rank is gone
        log.error("rank left the group", extra={"rank": rank})
        self.lost.set()
        writer.close()

    async def _connect(self) -> None:
        while True:
            try:
                reader, writer = await asyncio.open_connection(self.host, self.port)
                break
            except OSError:
                await asyncio.sleep(0.2)
        writer.write(HELLO + str(self.node_rank).encode() + b"\n")
        await writer.drain()
        self.all_connected.set()
        with contextlib.suppress(ConnectionError):
            await reader.read()
        log.error("lost connection to rank 0")
        self.lost.set()

    def close(self) -> None:
        if self._server is not None:
            self._server.close()
