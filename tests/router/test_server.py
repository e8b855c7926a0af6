"""The router's HTTP/1.1 server (``tandem_router.server``) on raw sockets: framing, limits, hostile input."""

from __future__ import annotations

import asyncio
import contextlib
import socket
import time
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager

import orjson
import pytest
import uvloop

from tandem_router.server import HttpServer, Limits, Reply, Response, ResponseStream, ServerRequest

pytestmark = pytest.mark.netns


class _App:
    def __init__(self) -> None:
        self.cancelled = asyncio.Event()
        self.started = asyncio.Event()

    async def handle(self, request: ServerRequest) -> Response:
        if request.path == "/stream":
            out = request.stream((("Content-Type", "text/event-stream"),))
            await out.prepare()
            for i in range(3):
                await out.write(b"data: %d\n\n" % i)
            await out.write_eof()
            return out
        if request.path == "/hang":
            self.started.set()
            try:
                await asyncio.sleep(60)
            except asyncio.CancelledError:
                self.cancelled.set()
                raise
        if request.path == "/big":
            out = request.stream(())
            for _ in range(64):
                await out.write(b"x" * 65536)  # 4 MiB: more than the transport buffers for a client not reading
            return out
        if request.path == "/boom":
            raise RuntimeError("boom")
        echo = {"method": request.method, "path": request.path, "body": len(request.body), "x": request.header("X-A")}
        return Reply(orjson.dumps(echo))


@asynccontextmanager
async def _served(**limits: float) -> AsyncIterator[tuple[_App, HttpServer, int]]:
    app = _App()
    server = HttpServer(app.handle, Limits(**limits))  # type: ignore[arg-type]
    await server.start("127.0.0.1", 0)
    try:
        yield app, server, server.address[1]
    finally:
        await server.drain(1.0)


async def _read_response(reader: asyncio.StreamReader) -> tuple[int, dict[str, str], bytes]:
    head = await reader.readuntil(b"\r\n\r\n")
    lines = head.decode().split("\r\n")
    status = int(lines[0].split()[1])
    headers = {k.lower(): v.strip() for k, v in (line.split(":", 1) for line in lines[1:] if line)}
    if "content-length" in headers:
        return status, headers, await reader.readexactly(int(headers["content-length"]))
    body = b""
    while True:
        size = int((await reader.readuntil(b"\r\n")).strip(), 16)
        chunk = await reader.readexactly(size + 2)
        if size == 0:
            return status, headers, body
        body += chunk[:-2]


async def _exchange(port: int, raw: bytes) -> tuple[int, dict[str, str], bytes]:
    reader, writer = await asyncio.open_connection("127.0.0.1", port)
    writer.write(raw)
    try:
        return await asyncio.wait_for(_read_response(reader), 5)
    finally:
        writer.close()


async def test_pipelined_requests_are_answered_in_order_on_one_connection() -> None:
    async with _served() as (_, _, port):
        reader, writer = await asyncio.open_connection("127.0.0.1", port)
        writer.write(
            b"POST /a HTTP/1.1\r\nHost: x\r\nX-A: 1\r\nContent-Length: 3\r\n\r\nabc"
            b"GET /stream HTTP/1.1\r\nHost: x\r\n\r\n"
            b"POST /c HTTP/1.1\r\nHost: x\r\nTransfer-Encoding: chunked\r\n\r\n2\r\nhi\r\n0\r\n\r\n"
        )
        first = await _read_response(reader)
        second = await _read_response(reader)
        third = await _read_response(reader)
        writer.close()
    assert orjson.loads(first[2]) == {"method": "POST", "path": "/a", "body": 3, "x": "1"}
    assert second[1]["transfer-encoding"] == "chunked"
    assert second[2] == b"data: 0\n\ndata: 1\n\ndata: 2\n\n"
    assert orjson.loads(third[2])["body"] == 2


@pytest.mark.parametrize(
    ("raw", "status"),
    [
        (b"POST /a HTTP/1.1\r\nContent-Length: 5000\r\n\r\n" + b"x" * 5000, 413),
        (b"POST /a HTTP/1.1\r\nTransfer-Encoding: chunked\r\n\r\n1400\r\n" + b"x" * 5120 + b"\r\n0\r\n\r\n", 413),
        (b"POST /a HTTP/1.1\r\nContent-Length: 5000\r\nExpect: 100-continue\r\n\r\n", 413),
        (b"GET /" + b"a" * 9000 + b" HTTP/1.1\r\n\r\n", 414),
        (b"GET /a HTTP/1.1\r\nX-Big: " + b"v" * 9000 + b"\r\n\r\n", 431),
        (b"GET /a HTTP/1.1\r\n" + b"".join(b"X-%d: v\r\n" % i for i in range(200)) + b"\r\n", 431),
        (b"GARBAGE\r\n\r\n", 400),
        (b"POST /a HTTP/1.1\r\nContent-Length: 1\r\nContent-Length: 2\r\n\r\nab", 400),
    ],
    ids=["length", "chunked", "expect", "url", "header", "headers", "malformed", "two-lengths"],
)
async def test_limits_and_malformed_requests_are_openai_errors_then_closed(raw: bytes, status: int) -> None:
    async with _served(max_body_bytes=4096) as (_, _, port):
        got, headers, body = await _exchange(port, raw)
    assert got == status
    assert headers["connection"] == "close"
    assert orjson.loads(body)["error"]["type"] == "invalid_request_error"


async def test_expect_continue_within_limits_gets_100_then_the_answer() -> None:
    async with _served() as (_, _, port):
        reader, writer = await asyncio.open_connection("127.0.0.1", port)
        writer.write(b"POST /a HTTP/1.1\r\nContent-Length: 2\r\nExpect: 100-continue\r\n\r\n")
        assert await reader.readuntil(b"\r\n\r\n") == b"HTTP/1.1 100 Continue\r\n\r\n"
        writer.write(b"ok")
        status, _, body = await _read_response(reader)
        writer.close()
    assert (status, orjson.loads(body)["body"]) == (200, 2)


async def test_a_client_that_leaves_cancels_its_request() -> None:
    async with _served() as (app, _, port):
        _, writer = await asyncio.open_connection("127.0.0.1", port)
        writer.write(b"GET /hang HTTP/1.1\r\n\r\n")
        await asyncio.wait_for(app.started.wait(), 5)
        writer.close()
        await asyncio.wait_for(app.cancelled.wait(), 5)


async def test_a_slow_sender_gets_408_and_an_idle_connection_is_closed() -> None:
    async with _served(request_timeout_s=0.3, keepalive_timeout_s=0.3) as (_, _, port):
        reader, writer = await asyncio.open_connection("127.0.0.1", port)
        writer.write(b"POST /a HTTP/1.1\r\nContent-Length: 10\r\n\r\nabc")
        status, _, _ = await asyncio.wait_for(_read_response(reader), 5)
        writer.close()
        assert status == 408
        reader, writer = await asyncio.open_connection("127.0.0.1", port)
        writer.write(b"GET /a HTTP/1.1\r\n\r\n")
        assert (await _read_response(reader))[0] == 200
        assert await asyncio.wait_for(reader.read(), 5) == b""  # closed once idle past the keep-alive timeout
        writer.close()


async def test_a_client_that_does_not_read_is_waited_for_then_dropped() -> None:
    async with _served(write_timeout_s=0.5) as (_, _, port):
        reader, writer = await asyncio.open_connection("127.0.0.1", port, limit=1024)
        writer.transport.pause_reading()  # type: ignore[attr-defined]
        writer.write(b"GET /big HTTP/1.1\r\n\r\n")
        await asyncio.sleep(3)
        writer.transport.resume_reading()  # type: ignore[attr-defined]
        received = 0
        while chunk := await asyncio.wait_for(reader.read(1 << 20), 5):
            received += len(chunk)
        writer.close()
    assert 0 < received < 4 * 1024 * 1024  # it stopped writing at the buffer limit, and gave up after the timeout


async def test_http10_streams_are_close_delimited_and_errors_are_500() -> None:
    async with _served() as (_, _, port):
        reader, writer = await asyncio.open_connection("127.0.0.1", port)
        writer.write(b"GET /stream HTTP/1.0\r\n\r\n")
        raw = await asyncio.wait_for(reader.read(-1), 5)
        writer.close()
        assert b"Transfer-Encoding" not in raw
        assert raw.endswith(b"data: 2\n\n")
        status, _, body = await _exchange(port, b"GET /boom HTTP/1.1\r\n\r\n")
    assert status == 500
    assert orjson.loads(body)["error"]["type"] == "server_error"


async def test_drain_lets_the_request_in_flight_finish_and_refuses_new_connections() -> None:
    async with _served() as (_, server, port):
        reader, writer = await asyncio.open_connection("127.0.0.1", port)
        writer.write(b"GET /stream HTTP/1.1\r\n\r\n")
        await asyncio.sleep(0.05)
        drained = asyncio.create_task(server.drain(5.0))
        status, _, _ = await asyncio.wait_for(_read_response(reader), 5)
        await drained
        writer.close()
        with pytest.raises(ConnectionRefusedError):
            await asyncio.open_connection("127.0.0.1", port)
    assert status == 200


def test_a_burst_of_connections_is_accepted_at_once_on_a_busy_uvloop() -> None:
    """500 clients connect at once while the loop is saturated (ten callbacks of 5 ms each per iteration): the
    listener takes every queued connection per readiness. libuv under uvloop takes one per loop iteration (libuv
    #3696), which would leave them queued for about 25 s."""

    async def burst() -> float:
        loop = asyncio.get_running_loop()
        async with _served() as (_, server, port):
            busy = True

            def hog() -> None:
                until = time.perf_counter() + 0.005
                while time.perf_counter() < until:
                    pass
                if busy:
                    loop.call_soon(hog)

            for _ in range(10):
                loop.call_soon(hog)
            clients = []
            try:
                started = time.monotonic()
                for _ in range(500):
                    sock = socket.socket()
                    sock.setblocking(False)
                    with contextlib.suppress(BlockingIOError):
                        sock.connect(("127.0.0.1", port))
                    clients.append(sock)
                while len(server.site.connections) < 500 and time.monotonic() - started < 20:  # noqa: ASYNC110 -- a count, no event
                    await asyncio.sleep(0.01)
                return time.monotonic() - started
            finally:
                busy = False
                for sock in clients:
                    sock.close()

    with asyncio.Runner(loop_factory=uvloop.new_event_loop) as runner:
        assert runner.run(burst()) < 5.0


class _Sent:
    """A channel that records each send (one send: one write syscall on the client's socket)."""

    lost = False
    paused = False

    def __init__(self) -> None:
        self.sends: list[bytes] = []

    def send(self, data: bytes) -> None:
        self.sends.append(data)

    async def drain(self) -> None:
        return None


@pytest.mark.parametrize(("chunked", "end"), [(True, b"4\r\nlast\r\n0\r\n\r\n"), (False, b"last")])
async def test_a_streams_last_bytes_and_its_end_go_out_in_one_send(chunked: bool, end: bytes) -> None:
    channel = _Sent()
    out = ResponseStream(channel, 200, (), chunked=chunked, keep_alive=True)
    await out.write(b"first")
    await out.write_eof(b"last")
    await out.write_eof(b"again")  # ended: nothing more goes out
    assert channel.sends[1:] == [end]
    assert channel.sends[0].endswith(b"\r\n\r\n5\r\nfirst\r\n" if chunked else b"\r\n\r\nfirst")
    whole = _Sent()  # a whole stream at once: head, bytes and end in one send
    await ResponseStream(whole, 200, (), chunked=True, keep_alive=True).write_eof(b"all")
    assert len(whole.sends) == 1
    assert whole.sends[0].endswith(b"\r\n\r\n3\r\nall\r\n0\r\n\r\n")
