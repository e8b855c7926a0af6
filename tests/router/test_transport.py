"""The router's HTTP/1.1 client (tandem_router.transport) against scripted workers: body framings, keep-alive
reuse, every failure mapped to a ``FailureReason`` (before and after the response head), pool limits, the order
in which waiting requests get connections."""

from __future__ import annotations

import asyncio
import contextlib
from collections.abc import AsyncIterator, Awaitable, Callable

import pytest
import uvloop

from tandem_dev.procs import free_port
from tandem_router.transport import FailureReason, Request, Transport, TransportConfig, WorkerError
from tandem_router.transport.client import WorkerResponse
from tandem_router.transport.http1 import Connection, WorkerConnections

Test = Callable[[], Awaitable[None]]


def on_both_loops(fn: Test) -> Callable[[Callable[[], asyncio.AbstractEventLoop]], None]:
    """Run on asyncio's loop and on uvloop (the router's), whose transports differ in timing."""

    @pytest.mark.parametrize("loop_factory", [asyncio.new_event_loop, uvloop.new_event_loop], ids=["asyncio", "uvloop"])
    def test(loop_factory: Callable[[], asyncio.AbstractEventLoop]) -> None:
        with asyncio.Runner(loop_factory=loop_factory) as runner:
            runner.run(fn())  # type: ignore[arg-type]

    test.__name__ = fn.__name__
    test.__doc__ = fn.__doc__
    return test


Handler = Callable[[asyncio.StreamReader, asyncio.StreamWriter], Awaitable[None]]


class ScriptedWorker:
    """A TCP server whose every connection runs ``handler``; counts connections and the most open at once."""

    def __init__(self, handler: Handler) -> None:
        self.handler = handler
        self.connections = 0
        self.open = 0
        self.most_open = 0
        self.server: asyncio.Server | None = None

    async def __aenter__(self) -> str:
        self.server = await asyncio.start_server(self._serve, "127.0.0.1", 0)
        return f"http://127.0.0.1:{self.server.sockets[0].getsockname()[1]}"

    async def __aexit__(self, *_: object) -> None:
        assert self.server is not None
        self.server.close()

    async def _serve(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        self.connections += 1
        self.open += 1
        self.most_open = max(self.most_open, self.open)
        try:
            await self.handler(reader, writer)
        except (ConnectionError, asyncio.IncompleteReadError):
            pass
        finally:
            self.open -= 1
            writer.close()


async def read_request(reader: asyncio.StreamReader) -> bytes:
    """One request (head and content-length body); b"" when the client closed."""
    head = await reader.readuntil(b"\r\n\r\n")
    length = 0
    for line in head.split(b"\r\n"):
        if line.lower().startswith(b"content-length:"):
            length = int(line.split(b":")[1])
    return head + await reader.readexactly(length)


async def _slow_ok(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
    """Every request answered "ok" after 50 ms."""
    while True:
        await read_request(reader)
        await asyncio.sleep(0.05)
        writer.write(b"HTTP/1.1 200 OK\r\nContent-Length: 2\r\n\r\nok")
        await writer.drain()


def keep_alive(body: bytes, extra: bytes = b"") -> Handler:
    async def handler(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        while True:
            await read_request(reader)
            writer.write(b"HTTP/1.1 200 OK\r\nContent-Length: %d\r\n%s\r\n%s" % (len(body), extra, body))
            await writer.drain()

    return handler


async def connections_for_two_gets(worker: ScriptedWorker, t: Transport, body: bytes, pause: float = 0.0) -> int:
    """Two GETs in a row, ``pause`` apart, each answered 200 ``body``: how many connections the worker saw."""
    async with worker as url:
        for n in range(2):
            await asyncio.sleep(pause * n)
            assert await t.get(url, "/health") == (200, body)
        await t.close()
    return worker.connections


def transport(**kw: float) -> Transport:
    return Transport(TransportConfig(**kw))  # type: ignore[arg-type]


@on_both_loops
async def test_content_length_bodies_reuse_one_kept_alive_connection() -> None:
    worker = ScriptedWorker(keep_alive(b'{"ok": true}', b"Content-Type: application/json\r\n"))
    t = transport()
    async with worker as url:
        for _ in range(3):
            async with await t.open_post(url, "/generate", b"{}", {"X-Request-Id": "r1"}) as resp:
                assert (resp.status, resp.headers["content-type"]) == (200, "application/json")
                assert await resp.read() == b'{"ok": true}'
        assert await t.get(url, "/health") == (200, b'{"ok": true}')
        await t.close()
    assert worker.connections == 1


@on_both_loops
async def test_chunked_sse_is_relayed_byte_for_byte_chunk_by_chunk() -> None:
    events = [b'data: {"a": 1}\n\n', b'data: {"b": "\\u00e9"}\n\n', b"data: [DONE]\n\n"]
    go = asyncio.Event()

    async def handler(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        await read_request(reader)
        writer.write(b"HTTP/1.1 200 OK\r\nTransfer-Encoding: chunked\r\nContent-Type: text/event-stream\r\n\r\n")
        writer.write(b"%x\r\n%s\r\n" % (len(events[0]), events[0]))
        await writer.drain()
        await go.wait()
        for event in events[1:]:
            writer.write(b"%x\r\n%s\r\n" % (len(event), event))
        writer.write(b"0\r\n\r\n")
        await read_request(reader)  # the connection is kept for the next request

    t = transport()
    async with ScriptedWorker(handler) as url:
        resp = await t.open_post(url, "/v1/chat/completions", b"{}")
        assert await resp.next_chunk() == events[0]  # delivered before the rest exists
        go.set()
        rest = [chunk async for chunk in resp]
        assert b"".join(rest) == b"".join(events[1:])
        resp.release()
        assert len(t.connections(url).idle) == 1
        await t.close()


@on_both_loops
async def test_a_body_delimited_by_close_is_read_and_its_connection_not_reused() -> None:
    async def handler(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        await read_request(reader)
        writer.write(b"HTTP/1.1 200 OK\r\nContent-Type: text/plain\r\n\r\nuntil the end")
        await writer.drain()

    assert await connections_for_two_gets(ScriptedWorker(handler), transport(), b"until the end") == 2


@on_both_loops
async def test_a_worker_saying_connection_close_is_not_reused() -> None:
    assert (
        await connections_for_two_gets(ScriptedWorker(keep_alive(b"x", b"Connection: close\r\n")), transport(), b"x")
        == 2
    )


@on_both_loops
async def test_a_response_closed_by_the_router_never_goes_back_to_the_pool() -> None:
    worker = ScriptedWorker(keep_alive(b"whole"))
    t = transport()
    async with worker as url:
        resp = await t.open_post(url, "/generate", b"{}")
        assert await resp.read() == b"whole"
        resp.close()  # e.g. an error event in a complete body: the router gives up on this connection
        assert not t.connections(url).idle
        assert await t.get(url, "/health") == (200, b"whole")
        await t.close()
    assert worker.connections == 2


@on_both_loops
async def test_closing_a_released_response_leaves_the_next_exchange_on_its_connection_alone() -> None:
    worker = ScriptedWorker(keep_alive(b"whole"))
    t = transport()
    async with worker as url:
        first = await t.open_post(url, "/generate", b"{}")
        assert await first.read() == b"whole"
        first.release()
        second = await t.open_post(url, "/generate", b"{}")  # on the connection the first one released
        first.close()
        assert await second.read() == b"whole"
        second.release()
        assert len(t.connections(url).idle) == 1
        await t.close()
    assert worker.connections == 1


@on_both_loops
async def test_closed_before_the_head_and_mid_body_are_closed_failures() -> None:
    async def before_head(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        await read_request(reader)

    async def mid_body(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        await read_request(reader)
        writer.write(b"HTTP/1.1 200 OK\r\nTransfer-Encoding: chunked\r\n\r\n5\r\nfirst\r\n")
        await writer.drain()

    t = transport()
    async with ScriptedWorker(before_head) as url:
        with pytest.raises(WorkerError) as caught:
            await t.open_post(url, "/generate", b"{}")
        assert caught.value.reason is FailureReason.CLOSED
        assert not caught.value.hard
        assert "before the response head" in str(caught.value)
    async with ScriptedWorker(mid_body) as url:
        resp = await t.open_post(url, "/generate", b"{}")
        assert resp.status == 200
        assert await resp.next_chunk() == b"first"  # what arrived is delivered before the failure
        with pytest.raises(WorkerError) as caught:
            await resp.next_chunk()
        assert caught.value.reason is FailureReason.CLOSED
        assert "mid-body" in str(caught.value)
        resp.release()
        assert not t.connections(url).idle
    await t.close()


@on_both_loops
async def test_connection_refused_is_unreachable_and_hard() -> None:
    t = transport()
    url = f"http://127.0.0.1:{free_port()}"
    with pytest.raises(WorkerError) as caught:
        await t.open_post(url, "/generate", b"{}")
    assert caught.value.reason is FailureReason.UNREACHABLE
    assert caught.value.hard
    assert t.connections(url).open == 0
    await t.close()


@on_both_loops
async def test_read_idle_timeout_before_the_head_and_between_chunks_and_the_connection_is_dropped() -> None:
    async def silent_after_first_chunk(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        request = await read_request(reader)
        if b"/head" in request:
            await asyncio.sleep(30)
        writer.write(b"HTTP/1.1 200 OK\r\nTransfer-Encoding: chunked\r\n\r\n2\r\nhi\r\n")
        await writer.drain()
        await asyncio.sleep(30)

    worker = ScriptedWorker(silent_after_first_chunk)
    t = transport(read_idle_timeout=0.2)
    async with worker as url:
        with pytest.raises(WorkerError) as caught:
            await t.open_post(url, "/head", b"{}")
        assert caught.value.reason is FailureReason.READ_TIMEOUT
        resp = await t.open_post(url, "/body", b"{}")
        assert await resp.next_chunk() == b"hi"
        with pytest.raises(WorkerError) as caught:
            await resp.next_chunk()
        assert caught.value.reason is FailureReason.READ_TIMEOUT
        resp.release()
        await asyncio.sleep(0.05)
        assert t.connections(url).open == 0  # neither connection went back to the pool
        await t.close()
    assert worker.connections == 2


@on_both_loops
async def test_malformed_responses_are_protocol_failures() -> None:
    answers = iter([b"HTTP/1.1 abc OK\r\n\r\n", b"HTTP/1.1 200 OK\r\nContent-Length: x\r\n\r\n", b"SSH-2.0-x\r\n"])

    async def handler(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        await read_request(reader)
        writer.write(next(answers))
        await writer.drain()
        await asyncio.sleep(30)

    worker = ScriptedWorker(handler)
    t = transport()
    async with worker as url:
        for _ in range(3):
            with pytest.raises(WorkerError) as caught:
                await t.open_post(url, "/generate", b"{}")
            assert caught.value.reason is FailureReason.PROTOCOL
        await t.close()
    assert worker.connections == 3


@on_both_loops
async def test_the_connection_limit_makes_requests_wait_for_a_free_connection() -> None:
    worker = ScriptedWorker(_slow_ok)
    t = Transport(TransportConfig(connections_per_worker=2, max_idle_per_worker=1))
    async with worker as url:

        async def one() -> bytes:
            async with await t.open_post(url, "/generate", b"{}") as resp:
                return await resp.read()

        assert await asyncio.gather(*(one() for _ in range(6))) == [b"ok"] * 6
        assert worker.most_open == 2
        pool = t.connections(url)
        await asyncio.sleep(0.05)
        assert (len(pool.idle), pool.open) == (1, 1)  # at most max_idle kept; the other was closed
        await t.close()


@on_both_loops
async def test_idle_connections_older_than_keepalive_are_closed_not_reused() -> None:
    worker = ScriptedWorker(keep_alive(b"x"))
    assert await connections_for_two_gets(worker, transport(keepalive_s=0.05), b"x", pause=0.1) == 2


def test_a_header_with_a_line_break_is_refused_before_sending() -> None:
    with pytest.raises(ValueError, match="CR or LF"):
        Request.build("POST", "/generate", b"{}", {"X-Request-Id": "a\r\nX-Evil: 1"})


@on_both_loops
async def test_retain_closes_the_connections_of_removed_workers() -> None:
    worker = ScriptedWorker(keep_alive(b"x"))
    t = transport()
    async with worker as url:
        assert await t.get(url, "/health") == (200, b"x")
        t.retain({url})
        assert len(t.connections(url).idle) == 1
        t.retain(set())
        await asyncio.sleep(0.05)
        assert worker.open == 0
        await t.close()


async def _served(t: Transport, url: str) -> WorkerResponse:
    """A response read to its end and not yet released: its connection stays the caller's."""
    resp = await t.open_post(url, "/generate", b"{}")
    assert await resp.read() == b"ok"
    return resp


@contextlib.asynccontextmanager
async def _one_held_connection() -> AsyncIterator[tuple[ScriptedWorker, Transport, WorkerConnections, WorkerResponse]]:
    """A worker's pool limited to one connection, held by a response read to its end."""
    worker = ScriptedWorker(keep_alive(b"ok"))
    t = Transport(TransportConfig(connections_per_worker=1))
    async with worker as url:
        yield worker, t, t.connections(url), await _served(t, url)
        await t.close()


async def _queued(pool: WorkerConnections, n: int) -> list[asyncio.Task[Connection]]:
    """``n`` requests for a connection, waiting in this order."""
    tasks = [asyncio.create_task(pool.acquire()) for _ in range(n)]
    await asyncio.sleep(0.01)
    return tasks


@on_both_loops
async def test_waiting_requests_are_served_in_arrival_order_and_a_later_one_never_overtakes() -> None:
    """A released connection goes to the oldest waiting request, even when a new request arrives before that one
    runs again (it used to go back to the idle list, where the newcomer took it and the waiter queued anew)."""
    async with _one_held_connection() as (worker, _, pool, held):
        first, second = await _queued(pool, 2)
        assert not first.done()
        assert not second.done()
        newcomer = asyncio.create_task(pool.acquire())  # its first step runs before ``first`` wakes up
        held.release()
        conn = await first
        await asyncio.sleep(0.01)
        assert not second.done()
        assert not newcomer.done()
        pool.release(conn)  # unused: still reusable
        assert await second is conn
        await asyncio.sleep(0.01)
        assert not newcomer.done()
        pool.release(conn)
        assert await newcomer is conn
        assert worker.connections == 1


@on_both_loops
async def test_a_connection_handed_to_a_cancelled_request_goes_to_the_next_one() -> None:
    async with _one_held_connection() as (worker, _, pool, held):
        gone, waiting = await _queued(pool, 2)
        held.release()  # handed to ``gone``...
        gone.cancel()  # ...which is cancelled before it runs
        conn = await waiting
        assert gone.cancelled()
        assert pool.open == 1
        assert worker.connections == 1
        pool.release(conn)


@on_both_loops
async def test_a_burst_opens_at_most_max_connecting_connections_at_once() -> None:
    """Forty requests at once against a worker that holds each response: never more than four connects in
    flight (a worker's accept queue drops the SYNs of a larger burst), and every request is answered."""

    worker = ScriptedWorker(_slow_ok)
    t = Transport(TransportConfig(max_connecting_per_worker=4))
    async with worker as url:
        pool = t.connections(url)
        connect, in_flight, most = pool._connect, 0, 0

        async def slow_connect() -> Connection:
            nonlocal in_flight, most
            in_flight += 1
            most = max(most, in_flight)
            try:
                await asyncio.sleep(0.01)  # a handshake that takes time
                return await connect()
            finally:
                in_flight -= 1

        pool._connect = slow_connect  # type: ignore[method-assign]

        async def one() -> bytes:
            async with await t.open_post(url, "/generate", b"{}") as resp:
                return await resp.read()

        assert await asyncio.gather(*(one() for _ in range(40))) == [b"ok"] * 40
        assert most == 4
        assert pool.connecting == 0
        assert pool.open == worker.connections
        await t.close()


@on_both_loops
async def test_closing_a_pool_fails_its_waiting_requests() -> None:
    async with _one_held_connection() as (_, t, pool, held):
        (waiting,) = await _queued(pool, 1)
        t.retain(set())
        with pytest.raises(WorkerError) as failed:
            await waiting
        assert failed.value.reason is FailureReason.CLOSED
        held.release()
