"""A lean HTTP/1.1 client connection: an asyncio protocol (uvloop in the router) with llhttp parsing responses.

One ``Connection`` carries one exchange at a time (no pipelining). The request head and body go out in one
``writelines``; the response is parsed by ``httptools.HttpResponseParser`` (llhttp, the parser of Node.js) as the
bytes arrive, and its body is handed to the reader exactly as parsed: chunked transfer framing is removed, the
payload (e.g. SSE events) is not touched. Bodies may be content-length, chunked or delimited by the worker
closing the connection. Whoever waits for a response's next bytes waits at most ``read_idle_timeout``; a silent
worker, a malformed response or a connection lost before the response ended is a ``WorkerError`` and the
connection is never reused. Reading is paused while more than ``HIGH_WATER`` body bytes wait for a slow reader.

``WorkerConnections`` is one worker's keep-alive pool: a connection goes back to it only when its response was
read to the end and the worker kept it alive; the newest idle connection is reused first, idle ones older than
``keepalive_s`` are closed, and at most ``max_idle`` are kept. ``limit`` bounds the open connections (0: none)
and ``max_connecting`` the connects in flight; a request that finds neither an idle connection nor a free slot
waits its turn (first come, first served).
"""

from __future__ import annotations

import asyncio
import collections
import ssl
import time
from typing import cast
from urllib.parse import urlsplit

import httptools

from tandem_router.transport.errors import FailureReason, WorkerError

HIGH_WATER = 256 * 1024


class Connection(asyncio.Protocol):
    def __init__(self, owner: WorkerConnections, read_idle_timeout: float) -> None:
        self.owner = owner
        self.read_idle_timeout = read_idle_timeout
        self.transport: asyncio.Transport | None = None
        self.closed = False  # connection_lost ran
        self.closing = False  # we closed it (connection_lost follows on a later loop iteration)
        self.idle_since = 0.0
        self.counted = False  # handed out by its pool, which counts it open until it is lost
        self._parser = httptools.HttpResponseParser(self)
        self._loop = asyncio.get_running_loop()
        self._waiter: asyncio.Future[None] | None = None
        self._wait_since = 0.0  # when the current wait began: the idle timeout counts from there
        self._timer: asyncio.TimerHandle | None = None  # the idle timer: one per connection, not one per wait
        self._paused = False
        self._start_exchange()

    def _start_exchange(self) -> None:
        self.status = 0
        self.raw_headers: list[tuple[bytes, bytes]] = []
        self.head_done = False
        self.complete = False
        self.keep_alive = False
        self.error: WorkerError | None = None
        self._body: list[bytes] = []
        self._buffered = 0

    # -- the exchange -------------------------------------------------------------------------------------------
    def send(self, parts: list[bytes]) -> None:
        self._start_exchange()
        assert self.transport is not None
        try:
            self.transport.writelines(parts)
        except (RuntimeError, OSError) as err:  # the transport closed under us
            raise WorkerError(
                FailureReason.CLOSED, f"{self.owner.url}: connection closed before sending ({err})"
            ) from err

    async def read_head(self) -> None:
        while not self.head_done:
            if self.error is not None:
                raise self.error
            await self._wait()

    async def next_chunk(self) -> bytes:
        """Body bytes received so far and not yet read (waiting for some); b"" once the body ended."""
        while True:
            if self._body:
                data = self._body[0] if len(self._body) == 1 else b"".join(self._body)
                self._body.clear()
                self._buffered = 0
                if self._paused and self.transport is not None and not self.closed:
                    self._paused = False
                    self.transport.resume_reading()
                return data
            if self.complete:
                return b""
            if self.error is not None:
                raise self.error
            await self._wait()

    @property
    def drained(self) -> bool:
        """The body ended and was read to its end: ``next_chunk`` returns b"" without waiting."""
        return self.complete and not self._body

    @property
    def reusable(self) -> bool:
        return self.complete and self.keep_alive and self.error is None and not self.closing and not self._body

    def close(self) -> None:
        self.closing = True
        if self.transport is not None and not self.closed:
            self.transport.close()

    async def _wait(self) -> None:
        waiter = self._waiter = self._loop.create_future()
        self._wait_since = self._loop.time()
        if self._timer is None:
            self._timer = self._loop.call_at(self._wait_since + self.read_idle_timeout, self._idle_check)
        try:
            await waiter
        finally:
            self._waiter = None

    def _idle_check(self) -> None:
        """The idle timer fired: a wait that lasted ``read_idle_timeout`` fails; one that began later re-arms it.
        (A stream waits once per chunk: a timer armed and cancelled per wait was a timer handle per chunk.)"""
        self._timer = None
        waiter = self._waiter
        if waiter is None or waiter.done():
            return  # nobody waits: the next wait arms it again
        due = self._wait_since + self.read_idle_timeout
        if self._loop.time() < due:
            self._timer = self._loop.call_at(due, self._idle_check)
            return
        self._fail(FailureReason.READ_TIMEOUT, f"no byte from the worker in {self.read_idle_timeout:g} s")
        self.close()

    def _wake(self) -> None:
        waiter = self._waiter
        if waiter is not None and not waiter.done():
            waiter.set_result(None)

    def _fail(self, reason: FailureReason, detail: str) -> None:
        if self.error is None and not self.complete:
            self.error = WorkerError(reason, f"{self.owner.url}: {detail}")
        self._wake()

    # -- asyncio.Protocol ---------------------------------------------------------------------------------------
    def connection_made(self, transport: asyncio.BaseTransport) -> None:
        self.transport = cast(asyncio.Transport, transport)  # uvloop's transports do not subclass asyncio's

    def data_received(self, data: bytes) -> None:
        try:
            self._parser.feed_data(data)
        except httptools.HttpParserError as err:
            self._fail(FailureReason.PROTOCOL, f"malformed response: {err}")
            self.close()
            return
        if self._buffered > HIGH_WATER and not self._paused and self.transport is not None:
            self._paused = True
            self.transport.pause_reading()

    def eof_received(self) -> bool:
        return False  # close our side too; connection_lost follows

    def connection_lost(self, exc: Exception | None) -> None:
        self.closed = self.closing = True
        if self._timer is not None:
            self._timer.cancel()
            self._timer = None
        if self.head_done and not self.complete and self._close_delimited():
            self.complete = True  # the body was delimited by the worker closing the connection
        elif not self.complete:
            where = "mid-body" if self.head_done else "before the response head"
            self._fail(FailureReason.CLOSED, f"connection closed {where}" + (f" ({exc})" if exc else ""))
        self._wake()
        self.owner.dropped(self)

    def _close_delimited(self) -> bool:
        names = {name.lower() for name, _ in self.raw_headers}
        return b"content-length" not in names and b"transfer-encoding" not in names

    # -- httptools callbacks -----------------------------------------------------------------------------------
    def on_header(self, name: bytes, value: bytes) -> None:
        self.raw_headers.append((name, value))

    def on_headers_complete(self) -> None:
        self.status = self._parser.get_status_code()
        self.head_done = True
        self._wake()

    def on_body(self, body: bytes) -> None:
        self._body.append(body)
        self._buffered += len(body)
        self._wake()

    def on_message_complete(self) -> None:
        self.complete = True
        self.keep_alive = self._parser.should_keep_alive()
        self._wake()


class WorkerConnections:
    """One worker's keep-alive connections, handed out in arrival order.

    A request takes an idle connection, or opens one while fewer than ``max_connecting`` connects to this worker
    are in flight (and fewer than ``limit`` are open); otherwise it waits in a FIFO queue, served by the next
    connection released or the next connect slot freed, and a request arriving later never overtakes one that
    waits. Bounding the connects in flight keeps a burst of requests (a thousand clients arriving at once) from
    sending a thousand SYNs at a worker whose accept queue holds fewer (SGLang's uvicorn listens with
    ``backlog=2048``, aiohttp with 128): the kernel drops the overflow and each dropped client waits out a 1 s SYN
    retransmission, which was the router's p99 at 1,000 streams (issue #42).
    """

    def __init__(
        self,
        url: str,
        *,
        connect_timeout: float,
        read_idle_timeout: float,
        limit: int = 0,
        max_idle: int = 4096,
        keepalive_s: float = 4.0,
        max_connecting: int = 32,
    ) -> None:
        parts = urlsplit(url)
        if parts.scheme not in ("http", "https") or not parts.hostname:
            raise ValueError(f"worker URL must be http(s)://host[:port]: {url!r}")
        self.url = url
        self.host = parts.hostname
        self.port = parts.port or (443 if parts.scheme == "https" else 80)
        self.ssl: ssl.SSLContext | None = ssl.create_default_context() if parts.scheme == "https" else None
        self.host_line = f"Host: {parts.netloc}\r\n".encode("latin-1")
        self.connect_timeout = connect_timeout
        self.read_idle_timeout = read_idle_timeout
        self.limit = limit
        self.max_idle = max_idle
        self.keepalive_s = keepalive_s
        self.max_connecting = max_connecting
        self.idle: collections.deque[Connection] = collections.deque()
        self.open = 0  # connections made or being made, and not yet lost (idle + busy + connecting)
        self.connecting = 0
        # Waiting requests, oldest first: each gets a connection, or None (a connect slot reserved for it).
        self._waiters: collections.deque[asyncio.Future[Connection | None]] = collections.deque()
        self._closed = False

    async def acquire(self) -> Connection:
        self._reap(time.monotonic())
        while self._waiters and self._waiters[0].done():  # cancelled while they waited
            self._waiters.popleft()
        if not self._waiters:
            if (conn := self._pop_idle()) is not None:
                return conn
            if self._may_connect():
                self._reserve()
                return await self._connect_reserved()
        waiter: asyncio.Future[Connection | None] = asyncio.get_running_loop().create_future()
        self._waiters.append(waiter)  # a cancelled waiter stays queued, done: the dispatch skips it
        self._dispatch()  # the waiters ahead may all be gone
        try:
            handed = await waiter
        except BaseException:
            if waiter.done() and not waiter.cancelled() and waiter.exception() is None:
                self._return(waiter.result())  # handed over as the request was cancelled: pass it on
            raise
        if handed is None:
            return await self._connect_reserved()
        return handed

    def _pop_idle(self) -> Connection | None:
        while self.idle:
            conn = self.idle.pop()  # the most recently used: warmest, least likely closed by the worker
            if not conn.closing:
                return conn
        return None

    def _may_connect(self) -> bool:
        return self.connecting < self.max_connecting and not (self.limit and self.open >= self.limit)

    def _reserve(self) -> None:
        self.open += 1
        self.connecting += 1

    async def _connect_reserved(self) -> Connection:
        try:
            conn = await self._connect()
        except BaseException:
            # Also when cancelled after the socket connected: asyncio closes that connection, whose loss must
            # then not be counted a second time (``counted`` is still False).
            self.open -= 1
            raise
        finally:
            self.connecting -= 1
            self._dispatch()
        conn.counted = True
        return conn

    def _return(self, handed: Connection | None) -> None:
        """A connection or connect slot handed to a request that no longer wants it."""
        if handed is None:
            self.open -= 1
            self.connecting -= 1
            self._dispatch()
        else:
            self.release(handed)

    async def _connect(self) -> Connection:
        loop = asyncio.get_running_loop()
        try:
            async with asyncio.timeout(self.connect_timeout):
                _, conn = await loop.create_connection(
                    lambda: Connection(self, self.read_idle_timeout),
                    self.host,
                    self.port,
                    ssl=self.ssl,
                    server_hostname=self.host if self.ssl else None,
                )
        except TimeoutError as err:
            raise WorkerError(
                FailureReason.CONNECT_TIMEOUT, f"{self.url}: no connection in {self.connect_timeout:g} s"
            ) from err
        except OSError as err:  # refused, unreachable, name not resolved, TLS handshake
            raise WorkerError(FailureReason.UNREACHABLE, f"{self.url}: {err}") from err
        return conn

    def release(self, conn: Connection) -> None:
        """The exchange on ``conn`` is over: keep it for the next one when it can be, else close it."""
        if conn.reusable and not self._closed and len(self.idle) < self.max_idle:
            conn.idle_since = time.monotonic()
            self.idle.append(conn)
            self._dispatch()
        else:
            conn.close()

    def dropped(self, conn: Connection) -> None:
        """``conn`` is closed (by either side): forget it."""
        if not conn.counted:
            return
        self.open -= 1
        if conn in self.idle:
            self.idle.remove(conn)
        self._dispatch()

    def _reap(self, now: float) -> None:
        while self.idle and now - self.idle[0].idle_since > self.keepalive_s:
            self.idle.popleft().close()

    def _dispatch(self) -> None:
        """Serve the oldest waiting requests: an idle connection each, else a connect slot while one is free."""
        while self._waiters:
            if self._waiters[0].done():  # cancelled while it waited
                self._waiters.popleft()
            elif (conn := self._pop_idle()) is not None:
                self._waiters.popleft().set_result(conn)
            elif self._may_connect() and not self._closed:
                self._reserve()
                self._waiters.popleft().set_result(None)
            else:
                return

    def close(self) -> None:
        self._closed = True
        while self.idle:
            self.idle.pop().close()
        while self._waiters:
            if not (waiter := self._waiters.popleft()).done():
                waiter.set_exception(WorkerError(FailureReason.CLOSED, f"{self.url}: removed from the router"))
