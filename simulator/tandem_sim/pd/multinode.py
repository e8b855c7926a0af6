"""Multi-node groups (``--nnodes N --node-rank i --dist-init-addr host:port``), as SGLang's torch.distributed group
behaves.

Node 0 listens on ``--dist-init-addr`` (torch's TCPStore server) and is not ready until nodes 1..N-1 have
connected; the others connect, retrying until rank 0 is up, and serve only the dummy health server on ``--port``
(SGLang's ``launch_dummy_health_check_server``). Start-up fails as torch's does: node 0 cannot bind the address,
a node cannot reach it, or node 0 waits for the others, each within ``--dist-timeout`` (default 600 s, torch's).
The group lives as long as every node does: when a connection drops, the other side exits, like a NCCL group that
loses a rank.

The connection also carries the scheduler's work to the ranks of the other nodes (SGLang broadcasts each batch
from TP rank 0 over the TP group): one JSON line per call, answered by one line with the same ``id``.
"""

from __future__ import annotations

import asyncio
import contextlib
import itertools
import logging
from collections.abc import Awaitable, Callable
from typing import Any

import orjson

log = logging.getLogger("tandem_sim.multinode")
HELLO = b"tandem-sim-rank "
LINE_LIMIT = 64 * 1024 * 1024  # a call carries a prompt's token ids or a rank's KV rows
Handler = Callable[[dict[str, Any]], Awaitable[dict[str, Any]]]


def split_addr(addr: str) -> tuple[str, int]:
    host, _, port = addr.rpartition(":")
    if not host or not port.isdigit():
        raise ValueError(f"--dist-init-addr must be host:port, got {addr!r}")
    return host.strip("[]"), int(port)


class GroupError(RuntimeError):
    """The group could not form (torch.distributed's message)."""


class Rendezvous:
    def __init__(
        self, nnodes: int, node_rank: int, dist_init_addr: str, timeout_s: float, handler: Handler | None = None
    ) -> None:
        self.nnodes = nnodes
        self.node_rank = node_rank
        self.host, self.port = split_addr(dist_init_addr)
        self.timeout_s = timeout_s
        self.handler = handler  # nodes > 0: runs the calls of node 0
        self.connected: set[int] = set()
        self.all_connected = asyncio.Event()
        self.lost = asyncio.Event()
        self.failure: str | None = None
        self._server: asyncio.Server | None = None
        self._writers: dict[int, asyncio.StreamWriter] = {}
        self._pending: dict[int, asyncio.Future[dict[str, Any]]] = {}
        self._ids = itertools.count()
        self._tasks: set[asyncio.Task[None]] = set()  # the loop only keeps weak references to tasks

    def _spawn(self, coro: Awaitable[None]) -> None:
        task = asyncio.ensure_future(coro)
        self._tasks.add(task)
        task.add_done_callback(self._tasks.discard)

    def _fail(self, message: str) -> None:
        if self.failure is None:
            self.failure = message
            log.error(message)
        self.lost.set()

    async def start(self) -> None:
        """Raises GroupError when node 0 cannot listen on ``--dist-init-addr``."""
        if self.node_rank == 0:
            try:
                self._server = await asyncio.start_server(self._on_peer, self.host, self.port, limit=LINE_LIMIT)
            except OSError as err:
                raise GroupError(
                    f"The server socket has failed to bind to {self.host}:{self.port} "
                    f"(errno: {err.errno} - {err.strerror})."
                ) from None
            self._spawn(self._wait_for_clients())
        else:
            self._spawn(self._connect())

    async def _wait_for_clients(self) -> None:
        try:
            await asyncio.wait_for(self.all_connected.wait(), self.timeout_s)
        except TimeoutError:
            self._fail(
                f"Timed out after {self.timeout_s:.0f} seconds waiting for clients. "
                f"{len(self.connected) + 1}/{self.nnodes} clients joined."
            )

    async def _on_peer(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
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
        self._writers[rank] = writer
        log.info("rank connected", extra={"rank": rank, "connected": len(self.connected) + 1, "nnodes": self.nnodes})
        if len(self.connected) >= self.nnodes - 1:
            self.all_connected.set()
        with contextlib.suppress(ConnectionError, ValueError):
            while line := await reader.readline():
                reply = orjson.loads(line)
                pending = self._pending.pop(int(reply.get("id", -1)), None)
                if pending is not None and not pending.done():
                    pending.set_result(reply)
        self._writers.pop(rank, None)
        self._fail(f"rank {rank} left the group")
        for pending in self._pending.values():
            if not pending.done():
                pending.set_exception(ConnectionError(f"node {rank} left the group"))
        writer.close()

    async def call(self, node: int, message: dict[str, Any]) -> dict[str, Any]:
        """Node 0: run ``message`` on ``node`` and return its answer."""
        writer = self._writers.get(node)
        if writer is None:
            raise ConnectionError(f"node {node} is not in the group")
        call_id = next(self._ids)
        done: asyncio.Future[dict[str, Any]] = asyncio.get_running_loop().create_future()
        self._pending[call_id] = done
        writer.write(orjson.dumps({**message, "id": call_id}) + b"\n")
        await writer.drain()
        return await done

    async def _connect(self) -> None:
        deadline = asyncio.get_running_loop().time() + self.timeout_s
        while True:
            try:
                reader, writer = await asyncio.open_connection(self.host, self.port, limit=LINE_LIMIT)
                break
            except OSError:
                if asyncio.get_running_loop().time() >= deadline:
                    self._fail(
                        f"The client socket has timed out after {self.timeout_s * 1000:.0f}ms while trying to "
                        f"connect to ({self.host}, {self.port})."
                    )
                    return
                await asyncio.sleep(0.2)
        writer.write(HELLO + str(self.node_rank).encode() + b"\n")
        await writer.drain()
        self.all_connected.set()
        with contextlib.suppress(ConnectionError, ValueError):
            while line := await reader.readline():
                self._spawn(self._serve_call(orjson.loads(line), writer))
        self._fail("lost connection to rank 0")

    async def _serve_call(self, message: dict[str, Any], writer: asyncio.StreamWriter) -> None:
        if self.handler is None:
            reply: dict[str, Any] = {"error": "this node runs no ranks"}
        else:
            try:
                reply = await self.handler(message)
            except Exception as err:  # the answer carries any failure back to node 0
                reply = {"error": f"{type(err).__name__}: {err}"}
        with contextlib.suppress(ConnectionError):
            writer.write(orjson.dumps({**reply, "id": message["id"]}) + b"\n")
            await writer.drain()

    def close(self) -> None:
        if self._server is not None:
            self._server.close()
