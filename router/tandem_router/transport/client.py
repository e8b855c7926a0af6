"""The one way the router talks to workers: a keep-alive pool per worker, responses as status, headers, bytes.

``Transport.open`` sends a prepared request and returns a ``WorkerResponse`` once the response head arrived,
whatever its status (a worker's 4xx/5xx is an answer, not a transport failure); its body is read with ``read``
or iterated chunk by chunk. Every failure to exchange is a ``WorkerError`` carrying a ``FailureReason``.

A request's head is serialised once (``Request``), then sent to as many workers as need it (the prefill and the
decode get the same body): only the request line and ``Host`` differ per worker. Keeping each worker's
connections in its own pool means a slow or dead worker cannot exhaust the connections of the others, and
dropping a worker closes exactly its sockets.
"""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator, Awaitable, Callable, Collection, Mapping
from dataclasses import dataclass

from tandem_router.transport.errors import FailureReason, WorkerError
from tandem_router.transport.http1 import Connection, WorkerConnections


@dataclass(frozen=True)
class TransportConfig:
    connect_timeout: float = 2.0
    read_idle_timeout: float = 300.0  # longest silence between two bytes of a worker's response
    probe_timeout: float = 5.0
    connections_per_worker: int = 0  # 0: unbounded
    max_idle_per_worker: int = 4096
    max_connecting_per_worker: int = 32  # connects in flight to one worker: below its accept queue (http1.py)
    # An idle connection older than this is closed rather than reused. Below SGLang's own keep-alive timeout
    # (uvicorn's timeout_keep_alive, SGLANG_TIMEOUT_KEEP_ALIVE = 5 s in sglang/srt/environ.py, passed by
    # sglang/srt/entrypoints/http_server.py): a request sent on a connection the worker is closing at that very
    # moment fails before its response head, a spurious failure of the pair.
    keepalive_s: float = 4.0


@dataclass(frozen=True)
class Request:
    """A request serialised once: the method and path, and the header lines and body every worker gets."""

    method: bytes
    path: bytes
    rest: bytes  # header lines after Host, the blank line
    body: bytes

    @classmethod
    def build(cls, method: str, path: str, body: bytes = b"", headers: Mapping[str, str] | None = None) -> Request:
        pairs = (headers or {}).items()
        if any(c in name or c in value for name, value in pairs for c in "\r\n"):
            raise ValueError("header names and values may not contain CR or LF")
        text = "".join(f"{name}: {value}\r\n" for name, value in pairs)
        if body or method != "GET":
            text += f"Content-Length: {len(body)}\r\n"
        return cls(method.encode(), path.encode("latin-1"), (text + "\r\n").encode("latin-1"), body)

    def parts(self, host_line: bytes) -> list[bytes]:
        return [self.method, b" ", self.path, b" HTTP/1.1\r\n", host_line, self.rest, self.body]


class WorkerResponse:
    """A worker's response: status and headers at once, the body as it arrives. ``release`` (or leaving the
    ``async with``) returns the connection to its pool when the body was read to the end, else closes it."""

    def __init__(self, conn: Connection) -> None:
        self._conn = conn
        # The connection's own reader: no coroutine of ours between the relay and each chunk.
        self.next_chunk: Callable[[], Awaitable[bytes]] = conn.next_chunk
        self.status = conn.status
        self.headers = {name.decode("latin-1").lower(): value.decode("latin-1") for name, value in conn.raw_headers}
        self._released = False

    @property
    def ended(self) -> bool:
        """The body was read to its end (the worker's stream is over; the next chunk is b"")."""
        return self._conn.drained

    async def read(self) -> bytes:
        parts = []
        while chunk := await self._conn.next_chunk():
            parts.append(chunk)
        return b"".join(parts)

    async def __aiter__(self) -> AsyncIterator[bytes]:
        while chunk := await self._conn.next_chunk():
            yield chunk

    def release(self) -> None:
        if not self._released:
            self._released = True
            self._conn.owner.release(self._conn)

    def close(self) -> None:
        """Give up on the rest of the body: the connection is closed (a streaming worker stops generating).
        Once released, the connection may already carry another request's exchange: it is left alone."""
        if not self._released:
            self._conn.close()
            self.release()

    async def __aenter__(self) -> WorkerResponse:
        return self

    async def __aexit__(self, *_: object) -> None:
        self.release()


class Transport:
    def __init__(self, cfg: TransportConfig | None = None) -> None:
        self.cfg = cfg or TransportConfig()
        self._workers: dict[str, WorkerConnections] = {}

    def connections(self, base_url: str) -> WorkerConnections:
        pool = self._workers.get(base_url)
        if pool is None:
            pool = self._workers[base_url] = WorkerConnections(
                base_url,
                connect_timeout=self.cfg.connect_timeout,
                read_idle_timeout=self.cfg.read_idle_timeout,
                limit=self.cfg.connections_per_worker,
                max_idle=self.cfg.max_idle_per_worker,
                keepalive_s=self.cfg.keepalive_s,
                max_connecting=self.cfg.max_connecting_per_worker,
            )
        return pool

    async def open(self, base_url: str, request: Request) -> WorkerResponse:
        """Send ``request`` and return once the response head arrived; the caller reads the body and releases."""
        pool = self.connections(base_url)
        conn = await pool.acquire()
        try:
            conn.send(request.parts(pool.host_line))
            await conn.read_head()
        except BaseException:
            conn.close()  # never reused: its pool forgets it once it is closed
            raise
        return WorkerResponse(conn)

    async def open_post(
        self, base_url: str, path: str, body: bytes, headers: Mapping[str, str] | None = None
    ) -> WorkerResponse:
        return await self.open(base_url, Request.build("POST", path, body, headers))

    async def get(self, base_url: str, path: str, probe_timeout: float | None = None) -> tuple[int, bytes]:
        """A short GET (health probe, /metrics, /v1/models): status and body, within the probe timeout."""
        timeout = probe_timeout or self.cfg.probe_timeout
        try:
            async with asyncio.timeout(timeout):
                async with await self.open(base_url, Request.build("GET", path)) as resp:
                    return resp.status, await resp.read()
        except TimeoutError as err:
            raise WorkerError(FailureReason.READ_TIMEOUT, f"{base_url}{path}: no answer in {timeout:g} s") from err

    def retain(self, base_urls: Collection[str]) -> None:
        """Close the pools of workers not in ``base_urls`` (removed from the router's pool): their idle sockets
        go now, busy ones when their exchange ends."""
        for url in [u for u in self._workers if u not in base_urls]:
            self._workers.pop(url).close()

    async def close(self) -> None:
        workers, self._workers = list(self._workers.values()), {}
        for pool in workers:
            pool.close()
