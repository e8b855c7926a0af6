"""Sending one request to one prefill/decode pair, and settling the pair once the relay is over.

``Dispatch.open_pair`` adds fresh bootstrap fields, POSTs the same body to the prefill and the decode concurrently,
and races the prefill failing against the decode's head + first chunk: the first chunk comes back as soon as it
arrives, without waiting for the prefill's body (drained in the background: it only reports whether the KV transfer
succeeded). The relay that sends the decode's stream on (``stream_relay``) and the retries before the first byte
(``proxy``) build on it; a relay ends with ``settle`` (the pair's lease released and scored) and ``report_texts``
(what the client received, to the integrity monitor and the shadow comparison).
"""

from __future__ import annotations

import asyncio
import logging
import random
import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any, Protocol

import orjson

from tandem.registry import Role
from tandem_router.metrics import RouterMetrics
from tandem_router.openai.errors import stream_error_status
from tandem_router.openai.requests import ParsedRequest
from tandem_router.policy import bootstrap, retry
from tandem_router.pool import Lease, Pair, WorkerPool
from tandem_router.transport import Request, Transport, WorkerError, WorkerResponse

log = logging.getLogger("tandem.router.proxy")

_ERROR_EVENT = b'data: {"error"'


@dataclass(frozen=True, slots=True)
class ProxyRequest:
    """A client request on its way to a pair: the request as parsed (its body and facts, ``ParsedRequest``) and
    what the router adds (the routing prefix, the request id, arrival, the prompt for observers, the client)."""

    parsed: ParsedRequest
    prefix: str | tuple[int, ...]  # prompt prefix (text or token ids), for cache-aware prefill choice
    request_id: str
    started: float  # monotonic time the request arrived
    prompt: str = ""  # the whole prompt as text, when an observer inspects responses
    client: str = ""  # who sent it (API key, trusted header or peer address): integrity evidence is per client


@dataclass
class Failure:
    reason: str
    retryable: bool
    status: int = 502
    body: bytes | None = None  # the worker's own error body (a client error's message)
    detail: str = ""
    hard: bool = False  # the worker is gone (its connection was refused): open its breaker at once
    unanswered: bool = False  # no answer came (the connection failed, closed or timed out): not an HTTP status

    @property
    def client_error(self) -> bool:
        """The worker refused the request itself (a 4xx that is not 408/429): the client's to fix."""
        return 400 <= self.status < 500 and not self.retryable


def http_failure(side: str, status: int, body: bytes) -> Failure:
    """A worker's non-200 answer: 408, 429, 500, 502-504 (any 5xx from the prefill, whose KV the decode waits for)
    are retryable, the worker's trouble; other 4xx are the client's."""
    if status < 400:
        return Failure(f"{side}_http_{status}", False, 502, detail="unexpected status")
    retryable = retry.is_retryable_status(status) or (side == "prefill" and status >= 500)
    return Failure(f"{side}_http_{status}", retryable, status, body)


def failed(lease: Lease, failure: Failure, role: Role) -> Failure:
    """A failure of ``role``'s side before the first byte: a retryable one scores that worker and the pair."""
    if failure.retryable:
        lease.failed(role, time.monotonic(), hard=failure.hard)
    return failure


def blame(prefill: Failure | None, decode: Failure) -> Failure:
    """Which side a failed attempt is counted against when the decode failed and the prefill's outcome is known.

    The prefill's failure explains a retryable decode failure when it is the client's (a 4xx refusal: nobody's
    fault), or when the prefill gave no answer at all (its connection was refused, closed or timed out: it is dead
    or hung) while the decode is alive and only reported, with an error event, that it got no KV
    (``decode_stream_error``): a dead prefill's decode aborts the request when it cannot fetch the prefill's
    bootstrap info (SGLang's ``DecodePreallocQueue._ensure_prefill_info``, ``disaggregation/decode.py``) or when
    its KV receiver is marked failed (``disaggregation/mooncake/conn.py``). When both finished before the router
    looked (a busy event loop sees them at once), the order they were read in says nothing. Two live workers that
    both report the transfer failed (a prefill's 5xx, the decode's error event: e.g. a decode back under its old
    Mooncake session) stay the decode's failure, as is any decode that itself broke (closed, refused, timed out,
    an HTTP status)."""
    if prefill is None or not decode.retryable:
        return decode
    if prefill.client_error or (prefill.unanswered and decode.reason == "decode_stream_error"):
        return prefill
    return decode


def transport_failure(side: str, err: WorkerError) -> Failure:
    """No answer from a worker (retryable); a refused connection is hard: the worker is gone."""
    return Failure(f"{side}_{err.reason.value}", True, hard=err.hard, detail=str(err), unanswered=True)


class ResponseObserver(Protocol):
    """Sees every request's prompt and the text the client received (the integrity monitor)."""

    def started(self, request_id: str, prompt: str, client: str) -> None: ...

    def finished(self, pair: tuple[str, str], request_id: str, prompt: str, outputs: list[str]) -> object: ...

    def released(self, request_id: str) -> None: ...


@dataclass(frozen=True)
class Opened:
    """A pair that answered: its lease (held until the relay settles it), the decode's response and first chunk."""

    lease: Lease
    resp: WorkerResponse
    first: bytes

    @property
    def pair(self) -> Pair:
        return self.lease.pair


class Dispatch:
    """Sends to pairs of ``pool`` over ``transport``; shows what the clients received to ``observer`` and
    ``on_complete``."""

    def __init__(
        self,
        pool: WorkerPool,
        transport: Transport,
        metrics: RouterMetrics,
        rng: random.Random,
        observer: ResponseObserver | None = None,
        on_complete: Callable[[Pair, ProxyRequest, list[str]], None] | None = None,
    ) -> None:
        self.pool = pool
        self.transport = transport
        self.metrics = metrics
        self.rng = rng
        self.observer = observer
        self.on_complete = on_complete  # sees each fully relayed response's texts (shadow comparison)
        self._background: set[asyncio.Task[None]] = set()

    async def open_pair(self, pair: Pair, req: ProxyRequest, request_body: dict[str, Any]) -> Opened | Failure:
        """Send to both workers of ``pair``: the decode's response and first chunk, or why there is none. On
        success the pair's lease stays held (``settle`` releases it) and the prefill is settled in the background."""
        body = bootstrap.inject(
            request_body,
            host=bootstrap.bootstrap_host(pair.prefill.url),
            port=pair.prefill.bootstrap_port,
            items=req.parsed.items,
            rng=self.rng,
            dp_size=pair.prefill.attn_dp_size,
        )
        headers = {"Content-Type": "application/json", "X-Request-Id": req.request_id}
        path = req.parsed.route.value
        request = Request.build("POST", path, orjson.dumps(body), headers)
        # The decode's attention-DP rank goes to the decode alone: a prefill would follow it too, against its room.
        rank = pair.decode_dp_rank
        decode_request = (
            request
            if rank is None
            else Request.build("POST", path, orjson.dumps({**body, "routed_dp_rank": rank}), headers)
        )
        lease = self.pool.lease(pair, time.monotonic())
        self.metrics.dispatched(pair)
        # The decode's request goes out first: the client's first byte follows the decode's answer, the prefill's
        # only settles the pair (SGLang's workers pair up through the bootstrap room, whichever arrives first).
        decode_task = asyncio.create_task(self._decode_head(pair, decode_request, req.parsed.stream))
        prefill_task = asyncio.create_task(self._prefill(pair, request))
        committed = False
        try:
            done, _ = await asyncio.wait({prefill_task, decode_task}, return_when=asyncio.FIRST_COMPLETED)
            if prefill_task in done and not decode_task.done():
                prefill_failure = prefill_task.result()
                if prefill_failure is not None:
                    decode_task.cancel()
                    return failed(lease, prefill_failure, Role.PREFILL)
            head = await decode_task
            if isinstance(head, Failure):
                blamed = blame(prefill_task.result() if prefill_task.done() else None, head)
                if blamed is not head:
                    return blamed if blamed.client_error else failed(lease, blamed, Role.PREFILL)
                prefill_task.cancel()
                return failed(lease, head, Role.DECODE)
            committed = True
            self._finish_prefill_later(lease, prefill_task)
            return Opened(lease, *head)
        finally:
            lease.prefilled()  # the decode's first chunk follows the prefill's KV, or the attempt is over
            if not committed:
                prefill_task.cancel()
                if not decode_task.cancel() and not decode_task.cancelled() and decode_task.exception() is None:
                    outcome = decode_task.result()  # it answered just as this attempt was given up
                    if isinstance(outcome, tuple):
                        outcome[0].close()
                lease.release(time.monotonic())

    async def _prefill(self, pair: Pair, request: Request) -> Failure | None:
        """Send to the prefill and drain its body: None when it finished (its KV transfer succeeded)."""
        try:
            async with await self.transport.open(pair.prefill.url, request) as resp:
                body = await resp.read()
                if resp.status >= 400:
                    return http_failure("prefill", resp.status, body)
                return None
        except WorkerError as err:
            return transport_failure("prefill", err)

    async def _decode_head(self, pair: Pair, request: Request, stream: bool) -> tuple[WorkerResponse, bytes] | Failure:
        """The decode's response head and its first chunk (the whole body when not streaming)."""
        try:
            resp = await self.transport.open(pair.decode.url, request)
        except WorkerError as err:
            return transport_failure("decode", err)
        try:
            if resp.status != 200:
                body = await resp.read()
                resp.release()
                return http_failure("decode", resp.status, body)
            first = await resp.next_chunk() if stream else await resp.read()
            if stream and (not first or first.startswith(_ERROR_EVENT)):
                # An empty stream or an error event before any token (e.g. the KV transfer failed): nothing has
                # reached the client yet, so this is retryable like an HTTP error, unless the event is a 4xx.
                resp.close()
                status = stream_error_status(first)
                if status is not None and status < 500 and not retry.is_retryable_status(status):
                    return Failure("decode_stream_error", False, status, first.split(b"\n\n", 1)[0][6:])
                return Failure("decode_stream_error", True, detail=first[:300].decode(errors="replace"))
            return resp, first
        except WorkerError as err:
            resp.close()
            return transport_failure("decode", err)
        except asyncio.CancelledError:
            resp.close()
            raise

    def _finish_prefill_later(self, lease: Lease, task: asyncio.Task[Failure | None]) -> None:
        """The prefill's outcome still scores the pair, but nobody waits for it."""

        async def settle() -> None:
            failure = await task
            if failure is None:
                lease.prefill_ok(time.monotonic())
            elif not failure.client_error:
                failed(lease, failure, Role.PREFILL)
                self.metrics.pair_failure(lease.pair, failure.reason)

        bg = asyncio.create_task(settle())
        self._background.add(bg)
        bg.add_done_callback(self._background.discard)

    def settle(self, opened: Opened, *, ok: bool, client_gone: bool) -> None:
        """A relay ended: the decode's connection released (closed unless clean), the lease released and scored
        (not when the client left: that says nothing about the pair)."""
        if ok:
            opened.resp.release()
        else:
            opened.resp.close()
        opened.lease.release(time.monotonic(), ok=None if client_gone else ok)

    def report_texts(self, pair: Pair, req: ProxyRequest, texts: list[str]) -> None:
        if self.observer is not None:
            self.observer.finished(pair.key, req.request_id, req.prompt, texts)
        if self.on_complete is not None:
            self.on_complete(pair, req, texts)

    async def drain_background(self) -> None:
        if self._background:
            await asyncio.gather(*self._background, return_exceptions=True)
