"""One client connection of the router's HTTP/1.1 server: an asyncio protocol with llhttp parsing requests.

Requests are parsed by ``httptools.HttpRequestParser`` as their bytes arrive and answered strictly in order, one
at a time (pipelining-safe): a request that arrives while another is being answered waits in a queue, and reading
pauses while one waits. Limits are enforced while parsing: the URL, each header and the whole head, the number of
headers, the body (``max_body_bytes``: 413, the rest of the body read and dropped) and the time from a request's
first byte to its last (``request_timeout_s``, against slow senders); every refusal is an OpenAI error, and the
connection is closed after it. A connection idle between requests is closed after ``keepalive_timeout_s``, and
one whose client stopped reading a response after ``write_timeout_s``. The client leaving (its connection closed
or reset) cancels the request being answered.
"""

from __future__ import annotations

import asyncio
import collections
import contextlib
import logging
import time
from collections.abc import Awaitable, Callable
from dataclasses import dataclass, field
from typing import cast
from urllib.parse import unquote

import httptools

from tandem_router.openai.schema import ErrorType, error_body
from tandem_router.server.messages import Reply, Response, ResponseStream, ServerRequest, head

log = logging.getLogger("tandem.router.server")

Handler = Callable[[ServerRequest], Awaitable[Response]]
_DISCARD_MAX = 16 * 1024 * 1024  # body bytes of a refused request read and dropped before giving up on it
_CONTINUE = b"HTTP/1.1 100 Continue\r\n\r\n"


@dataclass(frozen=True)
class Limits:
    max_body_bytes: int = 4 * 1024 * 1024
    max_url_bytes: int = 8190
    max_field_bytes: int = 8190  # one header name or value
    max_head_bytes: int = 65536  # URL and all headers
    max_headers: int = 128
    request_timeout_s: float = 60.0  # a request's first byte to its last
    keepalive_timeout_s: float = 75.0  # idle between requests
    write_timeout_s: float = 60.0  # a response waiting for a client that does not read


@dataclass
class Site:
    """What a server's connections share."""

    handler: Handler
    limits: Limits
    connections: set[ServerConnection] = field(default_factory=set)
    draining: bool = False
    settled: asyncio.Event = field(default_factory=asyncio.Event)  # set while draining when a request ends

    def request_ended(self) -> None:
        if self.draining:
            self.settled.set()


def error_reply(status: int, message: str, type_: ErrorType = ErrorType.INVALID_REQUEST) -> Reply:
    return Reply(error_body(message, type_), status=status)


class _RefusedError(Exception):
    def __init__(self, status: int, message: str) -> None:
        super().__init__(message)
        self.status = status


class ServerConnection(asyncio.Protocol):
    def __init__(self, site: Site) -> None:
        self.site = site
        self.limits = site.limits
        self.transport: asyncio.Transport | None = None
        self.remote: str | None = None
        self.lost = False
        self.paused = False  # writing: the client reads slower than we write
        self.deadline = 0.0  # monotonic time this connection is closed at unless something happens (0: none)
        self.queue: collections.deque[ServerRequest | Reply] = collections.deque()
        self.task: asyncio.Task[None] | None = None
        self._loop = asyncio.get_running_loop()
        self._parser = httptools.HttpRequestParser(self)
        self._broken = False  # a refusal is queued: nothing more is parsed
        self._reading_paused = False
        self._drain_waiter: asyncio.Future[None] | None = None
        self._sent = False  # bytes of the current response went out
        self._in_message = False
        self._in_head = False
        self._head_received = 0  # bytes received while a head is incomplete (llhttp buffers a header whole)
        self._reset_message()

    def _reset_message(self) -> None:
        self._url = b""
        self._headers: dict[str, str] = {}
        self._head_bytes = 0
        self._body: list[bytes] = []
        self._body_bytes = 0
        self._too_large = False

    # -- asyncio.Protocol ---------------------------------------------------------------------------------------
    def connection_made(self, transport: asyncio.BaseTransport) -> None:
        self.transport = cast(asyncio.Transport, transport)  # uvloop's transports do not subclass asyncio's
        self.transport.set_write_buffer_limits(high=256 * 1024)
        peer = transport.get_extra_info("peername")
        self.remote = str(peer[0]) if isinstance(peer, tuple) and peer else None
        self.deadline = time.monotonic() + self.limits.request_timeout_s
        self.site.connections.add(self)

    def data_received(self, data: bytes) -> None:
        if self._broken:
            return
        try:
            self._parser.feed_data(data)
        except httptools.HttpParserUpgrade as upgrade:
            # An upgrade we do not take (e.g. h2c): the request was answered as HTTP/1.1; parse on from its end.
            self._parser = httptools.HttpRequestParser(self)
            rest = data[int(upgrade.args[0]) :] if upgrade.args else b""
            if rest:
                self.data_received(rest)
        except httptools.HttpParserError as err:
            refused = err.__context__ if isinstance(err.__context__, _RefusedError) else None
            if refused is None:
                self._refuse(400, f"malformed HTTP request: {err}")
            else:
                self._refuse(refused.status, str(refused))
            return
        if self._in_head:
            self._head_received += len(data)
            if self._head_received > self.limits.max_head_bytes + self.limits.max_url_bytes:
                self._refuse(431, f"request head exceeds {self.limits.max_head_bytes} bytes")

    def eof_received(self) -> bool:
        return False  # the client closed its side: it left; connection_lost follows

    def connection_lost(self, exc: Exception | None) -> None:
        self.lost = True
        self.site.connections.discard(self)
        self.queue.clear()
        waiter = self._drain_waiter
        if waiter is not None and not waiter.done():
            waiter.set_exception(ConnectionResetError("the client disconnected"))
        if self.task is not None:
            self.task.cancel()  # the client left: stop its request (and the upstream exchange with it)
        self.site.request_ended()

    def pause_writing(self) -> None:
        self.paused = True

    def resume_writing(self) -> None:
        self.paused = False
        waiter = self._drain_waiter
        if waiter is not None and not waiter.done():
            waiter.set_result(None)

    # -- the channel a response stream writes to ---------------------------------------------------------------
    def send(self, data: bytes) -> None:
        assert self.transport is not None
        self._sent = True
        self.transport.write(data)

    async def drain(self) -> None:
        if self.lost:
            raise ConnectionResetError("the client disconnected")
        if not self.paused:
            return
        waiter = self._drain_waiter = self._loop.create_future()
        self.deadline = time.monotonic() + self.limits.write_timeout_s
        try:
            await waiter
        finally:
            self._drain_waiter = None
            self.deadline = 0.0

    # -- httptools callbacks -----------------------------------------------------------------------------------
    def on_message_begin(self) -> None:
        self._in_message = self._in_head = True
        self._head_received = 0
        self.deadline = time.monotonic() + self.limits.request_timeout_s

    def on_url(self, url: bytes) -> None:
        self._url += url
        if len(self._url) > self.limits.max_url_bytes:
            raise _RefusedError(414, f"request URL exceeds {self.limits.max_url_bytes} bytes")

    def on_header(self, name: bytes, value: bytes) -> None:
        limits = self.limits
        self._head_bytes += len(name) + len(value)
        if len(name) > limits.max_field_bytes or len(value) > limits.max_field_bytes:
            raise _RefusedError(431, f"a request header exceeds {limits.max_field_bytes} bytes")
        if self._head_bytes > limits.max_head_bytes or len(self._headers) >= limits.max_headers:
            raise _RefusedError(
                431, f"request headers exceed {limits.max_head_bytes} bytes or {limits.max_headers} lines"
            )
        self._headers.setdefault(name.decode("latin-1").lower(), value.decode("utf-8", "surrogateescape"))

    def on_headers_complete(self) -> None:
        self._in_head = False
        length = self._headers.get("content-length")
        if length is not None and length.isdigit() and int(length) > self.limits.max_body_bytes:
            self._too_large = True
        if self._headers.get("expect", "").lower() == "100-continue":
            if self._too_large:
                raise _RefusedError(413, self._too_large_message())  # the client waits: it never sends the body
            if self.task is None and not self.queue and self.transport is not None:
                self.transport.write(_CONTINUE)

    def on_body(self, body: bytes) -> None:
        self._body_bytes += len(body)
        if self._too_large:
            if self._body_bytes > _DISCARD_MAX:
                raise _RefusedError(413, self._too_large_message())
            return
        if self._body_bytes > self.limits.max_body_bytes:
            self._too_large = True
            self._body.clear()
            return
        self._body.append(body)

    def on_message_complete(self) -> None:
        self._in_message = False
        self.deadline = 0.0
        if self._too_large:
            self.queue.append(error_reply(413, self._too_large_message()))
            self._broken = True  # answered, then closed
        else:
            self.queue.append(self._request())
        self._reset_message()
        self._schedule()

    def _too_large_message(self) -> str:
        return f"request body exceeds {self.limits.max_body_bytes} bytes"

    def _request(self) -> ServerRequest:
        parser = self._parser
        url = self._url
        if not url.startswith(b"/"):
            url = httptools.parse_url(url).path or b"/"  # absolute form: http://host/path
        path, _, query = url.partition(b"?")
        text = path.decode("latin-1")
        body = self._body[0] if len(self._body) == 1 else b"".join(self._body)
        return ServerRequest(
            self,
            parser.get_method().decode("latin-1"),
            unquote(text) if "%" in text else text,
            query.decode("latin-1"),
            self._headers,
            body,
            version=parser.get_http_version(),
            keep_alive=parser.should_keep_alive(),
            remote=self.remote,
        )

    # -- answering ---------------------------------------------------------------------------------------------
    def _refuse(self, status: int, message: str) -> None:
        """A request we will not parse further: answered (in order) with an OpenAI error, then the connection
        closes."""
        self._broken = True
        self.queue.append(error_reply(status, message))
        self._schedule()

    def _schedule(self) -> None:
        if self.lost:
            return
        if self.task is None:
            self.task = self._loop.create_task(self._answer())
        elif not self._reading_paused and self.transport is not None:
            self._reading_paused = True  # a pipelined request waits: read no more until it is answered
            self.transport.pause_reading()

    async def _answer(self) -> None:
        try:
            while self.queue and not self.lost:
                item = self.queue.popleft()
                if self._reading_paused and not self.queue and not self._broken and self.transport is not None:
                    self._reading_paused = False
                    self.transport.resume_reading()
                if isinstance(item, Reply):
                    self._write_reply(item, keep_alive=False, http10=False, head_only=False)
                    self.close()
                    return
                if not await self._serve(item):
                    self.close()
                    return
            if not self.lost:
                if self.site.draining and not self._in_message:
                    self.close()
                elif not self._in_message:
                    self.deadline = time.monotonic() + self.limits.keepalive_timeout_s
        except Exception:
            log.exception("unhandled error answering a request")
            self.close()
        finally:
            self.task = None
            self.site.request_ended()

    async def _serve(self, request: ServerRequest) -> bool:
        """Answer one request; whether the connection stays open for the next."""
        self._sent = False
        try:
            response = await self.site.handler(request)
        except Exception:
            log.exception("unhandled error", extra={"path": request.path})
            if self._sent:
                return False  # a stream broke off: only closing the connection tells the client
            response = error_reply(500, "internal router error", ErrorType.SERVER)
        keep_alive = request.keep_alive and not self.site.draining
        if isinstance(response, ResponseStream):
            if not response.ended and not self.lost:
                await response.write_eof()
        else:
            self._write_reply(
                response, keep_alive=keep_alive, http10=request.version == "1.0", head_only=request.method == "HEAD"
            )
        if self.paused and not self.lost:
            with contextlib.suppress(ConnectionResetError):
                await self.drain()
        return keep_alive and not self.lost

    def _write_reply(self, reply: Reply, *, keep_alive: bool, http10: bool, head_only: bool) -> None:
        if self.lost or self.transport is None:
            return
        framing = b"Content-Length: %d\r\n" % len(reply.body)
        if not keep_alive:
            framing += b"Connection: close\r\n"
        elif http10:
            framing += b"Connection: keep-alive\r\n"
        data = head(reply.status, reply.headers, framing)
        self.transport.write(data if head_only else data + reply.body)

    # -- closing -----------------------------------------------------------------------------------------------
    @property
    def idle(self) -> bool:
        return self.idle_answering and not self._in_message

    def close(self) -> None:
        """Close after what was written went out."""
        if self.transport is not None and not self.lost:
            self.transport.close()

    def expire(self) -> None:
        """The deadline passed: a slow sender gets a 408, an idle or unread connection is dropped."""
        if self.lost or self.transport is None:
            return
        if self._in_message and self.idle_answering:
            self._write_reply(
                error_reply(408, "request not received in time"), keep_alive=False, http10=False, head_only=False
            )
            self.transport.close()
        else:
            self.transport.abort()

    @property
    def idle_answering(self) -> bool:
        return self.task is None and not self.queue
