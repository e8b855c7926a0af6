"""What a handler of the router's HTTP/1.1 server sees and answers: the parsed request, a whole reply, a stream.

Heads are serialised here, once per response, as bytes; bodies are written as given (no re-encoding). A stream
is chunked for HTTP/1.1 clients and delimited by closing the connection for HTTP/1.0 ones; its head goes out
with its first bytes, in one write.
"""

from __future__ import annotations

import time
from collections.abc import Sequence
from email.utils import formatdate
from http import HTTPStatus
from typing import Protocol

Headers = Sequence[tuple[str, str]]

_REASONS = {s.value: s.phrase.encode() for s in HTTPStatus}


def status_line(status: int) -> bytes:
    return b"HTTP/1.1 %d %s\r\n" % (status, _REASONS.get(status, b"Unknown"))


class _Clock:
    """The ``Date`` header line, formatted at most once a second."""

    def __init__(self) -> None:
        self.second = 0
        self.line = b""

    def date_line(self) -> bytes:
        now = int(time.time())
        if now != self.second:
            self.second = now
            self.line = b"Date: " + formatdate(now, usegmt=True).encode() + b"\r\n"
        return self.line


CLOCK = _Clock()


def head(status: int, headers: Headers, framing: bytes) -> bytes:
    """A response head: status line, the handler's headers, Date, then ``framing`` (length/encoding/connection)."""
    parts = [status_line(status)]
    parts.extend(f"{name}: {value}\r\n".encode("latin-1") for name, value in headers)
    parts.append(CLOCK.date_line())
    parts.append(framing)
    parts.append(b"\r\n")
    return b"".join(parts)


class Reply:
    """A whole response: status, headers and body bytes (``Content-Length`` is added when it is written)."""

    __slots__ = ("body", "headers", "status")

    def __init__(
        self,
        body: bytes = b"",
        *,
        status: int = 200,
        content_type: str = "application/json",
        headers: Headers = (),
    ) -> None:
        self.status = status
        self.body = body
        self.headers: Headers = (("Content-Type", content_type), *headers)


class Channel(Protocol):
    """The connection a stream writes to (``protocol.ServerConnection``)."""

    lost: bool  # the client is gone
    paused: bool  # the transport's write buffer is full: ``drain`` before writing more

    def send(self, data: bytes) -> None: ...

    async def drain(self) -> None: ...


class ResponseStream:
    """A response written as it is produced (SSE). ``write`` raises ``ConnectionResetError`` once the client is
    gone, and waits while the client reads slower than the stream is written (the transport's buffer is full)."""

    __slots__ = ("_channel", "_chunked", "_head", "ended", "status")

    def __init__(self, channel: Channel, status: int, headers: Headers, *, chunked: bool, keep_alive: bool) -> None:
        self.status = status
        self._channel = channel
        self._chunked = chunked
        if chunked:
            framing = b"Transfer-Encoding: chunked\r\n" + (b"" if keep_alive else b"Connection: close\r\n")
        else:
            framing = b"Connection: close\r\n"
        self._head: bytes | None = head(status, headers, framing)
        self.ended = False

    @property
    def client_gone(self) -> bool:
        return self._channel.lost

    async def prepare(self) -> None:
        """Commit to streaming; the head goes out with the first bytes written."""
        if self._channel.lost:
            raise ConnectionResetError("the client disconnected")

    async def write(self, data: bytes) -> None:
        channel = self._channel
        if channel.lost:
            raise ConnectionResetError("the client disconnected")
        if not data:
            return  # a zero-length chunk would end a chunked body
        if self._chunked:
            data = b"%x\r\n%b\r\n" % (len(data), data)
        if self._head is not None:
            data = self._head + data
            self._head = None
        channel.send(data)
        if channel.paused:
            await channel.drain()

    async def write_eof(self, data: bytes = b"") -> None:
        """End the response; ``data``, its last bytes, go out with the end in one write (one send, not two)."""
        if self.ended:
            return
        self.ended = True
        channel = self._channel
        if channel.lost:
            raise ConnectionResetError("the client disconnected")
        if not self._chunked:
            tail = data
        elif data:
            tail = b"%x\r\n%b\r\n0\r\n\r\n" % (len(data), data)
        else:
            tail = b"0\r\n\r\n"
        if self._head is not None:
            tail = self._head + tail
            self._head = None
        if tail:
            channel.send(tail)


Response = Reply | ResponseStream


class ServerRequest:
    """One parsed request: header names lower-cased (the first of repeated headers wins), the whole body."""

    __slots__ = ("_channel", "body", "headers", "keep_alive", "method", "path", "query", "remote", "version")

    def __init__(
        self,
        channel: Channel,
        method: str,
        path: str,
        query: str,
        headers: dict[str, str],
        body: bytes,
        *,
        version: str,
        keep_alive: bool,
        remote: str | None,
    ) -> None:
        self._channel = channel
        self.method = method
        self.path = path
        self.query = query
        self.headers = headers
        self.body = body
        self.version = version
        self.keep_alive = keep_alive
        self.remote = remote

    def header(self, name: str, default: str = "") -> str:
        return self.headers.get(name.lower(), default)

    def stream(self, headers: Headers, status: int = 200) -> ResponseStream:
        """A streamed response to this request (chunked, or close-delimited for an HTTP/1.0 client)."""
        chunked = self.version != "1.0"
        self.keep_alive = self.keep_alive and chunked
        return ResponseStream(self._channel, status, headers, chunked=chunked, keep_alive=self.keep_alive)
