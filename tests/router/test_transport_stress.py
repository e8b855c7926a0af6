"""The router's HTTP/1.1 client under randomised abuse: no request hangs and no byte is lost or invented.

A local worker answers each request from a plan drawn from the request's seed: body framing (content-length,
chunked, delimited by close), the response's bytes cut at random points and written with random pauses, the
connection closed mid-response (before the head, mid-body, mid chunk framing) or reset, keep-alive or not, and
idle kept-alive connections closed by the worker after a random short while (as uvicorn's keep-alive timeout
does), racing the router's reuse of them. Many requests run at once, with readers that read all at once, read
slowly (with a tiny pause threshold so that reading is paused and resumed often), give up mid-body, or are
cancelled at a random moment (during connect, the head, or the body), against a pool with and without a
connection limit (a lost slot would make later requests wait for ever).

Each request must end within a generous bound (a hang is the failure sought) with the exact body, or a
``WorkerError``; a body delimited by close and cut by the worker may end early (HTTP cannot tell). At the end the
pool's bookkeeping must agree with the sockets: every connection it counts open is idle in it, and the worker
sees exactly those open.
"""

from __future__ import annotations

import asyncio
import random
from dataclasses import dataclass

import pytest

from tandem_router.transport import Request, Transport, TransportConfig, WorkerError, WorkerResponse, http1
from tests.router.test_transport import on_both_loops, read_request

REQUESTS = 1000
CONCURRENCY = 48
HANG_BOUND_S = 20.0  # far above any request here (a few ms each): reaching it is a hang

# A load test (1,000 requests per loop and pool, ~6 s of CPU in all): `make test` runs it, `make unit` does not.
pytestmark = pytest.mark.slow


@dataclass(frozen=True)
class Plan:
    """The worker's answer to one request, drawn from its seed so that the client knows what to expect."""

    body: bytes
    framing: str  # "length", "chunked" or "close"
    keep_alive: bool
    wire: bytes  # the whole response as the worker would send it
    cut: int | None  # the worker stops (and closes) after this many bytes of ``wire``; None: all of it
    reset: bool  # abort (RST) instead of a clean close at the cut
    pieces: tuple[int, ...]  # write boundaries in ``wire``
    delays: tuple[float, ...]  # pause before each piece
    idle_close_s: float | None  # after a complete keep-alive answer, close the idle connection this much later

    @classmethod
    def draw(cls, seed: int) -> Plan:
        rng = random.Random(seed)
        size = rng.choice([0, 1, rng.randint(2, 200), rng.randint(200, 5000), rng.randint(5000, 70_000)])
        body = rng.randbytes(size)
        framing = rng.choice(["length", "chunked", "close"])
        keep_alive = framing != "close" and rng.random() < 0.8
        head = b"HTTP/1.1 200 OK\r\nContent-Type: application/octet-stream\r\n"
        if framing == "length":
            head += b"Content-Length: %d\r\n" % size
            framed = body
        elif framing == "chunked":
            head += b"Transfer-Encoding: chunked\r\n"
            framed = _chunked(body, rng)
        else:
            framed = body
        if not keep_alive:
            head += b"Connection: close\r\n"
        head += b"\r\n"
        wire = head + framed
        cut: int | None = None
        fault = rng.random()
        if fault < 0.08:
            cut = rng.randint(0, len(head) - 1)  # before the head ended
        elif fault < 0.2 and len(wire) > len(head) and (framing != "close" or size > 0):
            cut = rng.randint(len(head), len(wire) - 1)  # mid-body, or mid chunk framing
        n_pieces = rng.choice([1, 1, 2, 3, rng.randint(4, 40)])
        end = len(wire) if cut is None else cut
        bounds = sorted({rng.randint(0, end) for _ in range(n_pieces - 1)} | {end})
        delays = tuple(rng.choice([0.0, 0.0, 0.0, 0.0005, 0.002]) for _ in bounds)
        idle_close = rng.choice([None, None, None, rng.uniform(0.0, 0.02)]) if keep_alive else None
        reset = rng.random() < 0.3
        return cls(body, framing, keep_alive, wire, cut, reset, tuple(bounds), delays, idle_close)


def _chunked(body: bytes, rng: random.Random) -> bytes:
    out, at = [], 0
    while at < len(body):
        n = min(len(body) - at, rng.randint(1, max(1, len(body) // rng.choice([1, 2, 5, 20]))))
        out.append(b"%x\r\n%s\r\n" % (n, body[at : at + n]))
        at += n
    return b"".join(out) + b"0\r\n\r\n"


class PlannedWorker:
    """Answers ``/s/<seed>`` by ``Plan.draw(seed)``; counts the connections open now."""

    def __init__(self) -> None:
        self.open = 0
        self.server: asyncio.Server | None = None

    async def start(self) -> str:
        self.server = await asyncio.start_server(self._serve, "127.0.0.1", 0)
        return f"http://127.0.0.1:{self.server.sockets[0].getsockname()[1]}"

    async def _serve(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        self.open += 1
        idle_close_s: float | None = None
        try:
            while True:
                try:
                    async with asyncio.timeout(idle_close_s):
                        first = await reader.readexactly(1)
                except TimeoutError:
                    return  # the keep-alive timeout: close the idle connection
                plan = Plan.draw(int((first + await read_request(reader)).split(b" ", 2)[1].rsplit(b"/", 1)[1]))
                if not await self._answer(plan, writer):
                    return
                idle_close_s = plan.idle_close_s
        except (ConnectionError, asyncio.IncompleteReadError):
            pass
        finally:
            self.open -= 1
            writer.close()

    async def _answer(self, plan: Plan, writer: asyncio.StreamWriter) -> bool:
        """Write the planned response; False when the connection is to be closed."""
        start = 0
        for end, delay in zip(plan.pieces, plan.delays, strict=True):
            if delay:
                await asyncio.sleep(delay)
            writer.write(plan.wire[start:end])
            start = end
        await writer.drain()
        if plan.cut is not None and plan.reset:
            writer.transport.abort()
        return plan.cut is None and plan.keep_alive


async def _exchange(t: Transport, url: str, seed: int, rng: random.Random) -> str:
    """One request read one of several ways; what happened ("ok", "short", "error", "cancelled")."""
    plan = Plan.draw(seed)
    style = rng.choice(["read", "iterate", "slow", "give_up", "cancel"])
    request = Request.build("POST", f"/s/{seed}", b"x" * rng.choice([0, 10, 3000]))
    if style == "cancel":
        task = asyncio.ensure_future(_read_all(t, url, request, slow=False))
        await asyncio.sleep(rng.choice([0, 0, 0.0005, 0.002, 0.005]))
        task.cancel()
        try:
            got = await task
        except asyncio.CancelledError:
            return "cancelled"
        except WorkerError:
            return "error"
        return _judge(plan, got)
    try:
        if style == "give_up":
            resp = await t.open(url, request)
            async with resp:
                await resp.next_chunk()
                resp.close()
            return "cancelled"
        got = await _read_all(t, url, request, slow=style == "slow", iterate=style == "iterate")
    except WorkerError:
        return "error"
    return _judge(plan, got)


def _judge(plan: Plan, got: bytes) -> str:
    if got == plan.body:
        return "ok"
    assert plan.framing == "close", f"{plan.framing} body of {len(plan.body)} B: got {len(got)} B"
    assert plan.cut is not None, f"an uncut body of {len(plan.body)} B: got {len(got)} B"
    assert plan.body.startswith(got)
    return "short"


async def _read_all(t: Transport, url: str, request: Request, *, slow: bool, iterate: bool = True) -> bytes:
    resp: WorkerResponse
    async with await t.open(url, request) as resp:
        assert resp.status == 200
        if not iterate:
            return await resp.read()
        parts = []
        async for chunk in resp:
            parts.append(chunk)
            if slow:
                await asyncio.sleep(0.001)
        return b"".join(parts)


async def _stress(limit: int) -> None:
    worker = PlannedWorker()
    url = await worker.start()
    t = Transport(TransportConfig(read_idle_timeout=HANG_BOUND_S * 2, connections_per_worker=limit))
    rng = random.Random(limit)
    seeds = iter(range(REQUESTS))
    outcomes: dict[str, int] = {}

    async def client() -> None:
        for seed in seeds:
            async with asyncio.timeout(HANG_BOUND_S):
                outcome = await _exchange(t, url, seed, rng)
            outcomes[outcome] = outcomes.get(outcome, 0) + 1

    await asyncio.gather(*(client() for _ in range(CONCURRENCY)))
    assert outcomes.get("ok", 0) > REQUESTS // 3, outcomes
    pool = t.connections(url)
    for _ in range(200):  # connections closed just now are lost on a later loop iteration
        if pool.open == len(pool.idle) == worker.open:
            break
        await asyncio.sleep(0.01)
    assert pool.open == len(pool.idle) == worker.open, (pool.open, len(pool.idle), worker.open)
    await t.close()
    for _ in range(200):
        if worker.open == 0:
            break
        await asyncio.sleep(0.01)
    assert worker.open == 0
    assert worker.server is not None
    worker.server.close()
    await worker.server.wait_closed()


@pytest.fixture(autouse=True)
def _pause_often(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(http1, "HIGH_WATER", 512)  # a slow reader makes the client pause and resume reading


@on_both_loops
async def test_random_framings_faults_and_cancellations_never_hang_nor_corrupt_unbounded_pool() -> None:
    await _stress(limit=0)


@on_both_loops
async def test_random_framings_faults_and_cancellations_never_hang_nor_leak_a_slot_of_a_bounded_pool() -> None:
    await _stress(limit=6)
