"""One client request through a prefill/decode pair: send to both at once, relay decode, retry before byte 1.

Per attempt: pick a pair (pool), add fresh bootstrap fields, POST the same body to the prefill and the decode
concurrently, and race three things: the prefill failing, the decode's head + first chunk, and nothing else.
The decode's first chunk is relayed as soon as it arrives, without waiting for the prefill's body (which is
drained in the background: it only reports whether the KV transfer succeeded). Until a byte reached the client,
a transport error or a retryable status on either side moves the request to another pair with a new room.
After that, a failure resumes the stream on a fresh pair where it can (``stream_relay``), else ends it with an
OpenAI error event. A worker's 4xx (other than 408/429), from
whichever side answers first, is the client's mistake: the other side is cancelled, nothing is retried or counted
against the pair, and the client gets the worker's message as an OpenAI error with the same status.
"""

from __future__ import annotations

import asyncio
import logging
import random
import time
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from typing import Any, Protocol

import aiohttp
import orjson
from aiohttp import web

from tandem_router.integrity.textextract import body_texts
from tandem_router.metrics import RouterMetrics
from tandem_router.openai.errors import client_error_body, stream_error_status
from tandem_router.openai.responses import conform_body
from tandem_router.policy import bootstrap, retry
from tandem_router.pool import Pair, WorkerPool
from tandem_router.resume import RESUME_OFF, Refusal, ResumeConfig, StreamLedger, new_ledger
from tandem_router.schema import ErrorType, Route, error_body
from tandem_router.stream_relay import StreamRelay
from tandem_router.transport import Transport, WorkerError, WorkerUnreachableError

log = logging.getLogger("tandem.router.proxy")

_ERROR_EVENT = b'data: {"error"'


@dataclass(frozen=True)
class ProxyRequest:
    route: Route
    body: dict[str, Any]
    stream: bool
    items: int  # 0: one sequence; else one bootstrap room per item
    prefix: str | tuple[int, ...]  # prompt prefix (text or token ids), for cache-aware prefill choice
    request_id: str
    started: float  # monotonic time the request arrived
    prompt: str = ""  # the whole prompt as text, when an observer inspects responses
    client: str = ""  # who sent it (API key, trusted header or peer address): integrity evidence is per client


@dataclass
class _Failure:
    reason: str
    retryable: bool
    status: int = 502
    body: bytes | None = None  # the worker's own error body (a client error's message)
    detail: str = ""

    @property
    def client_error(self) -> bool:
        """The worker refused the request itself (a 4xx that is not 408/429): the client's to fix."""
        return 400 <= self.status < 500 and not self.retryable


def _http_failure(side: str, status: int, body: bytes) -> _Failure:
    """A worker's non-200 answer: 408, 429, 500, 502-504 (any 5xx from the prefill, whose KV the decode waits for)
    are retryable, the worker's trouble; other 4xx are the client's."""
    if status < 400:
        return _Failure(f"{side}_http_{status}", False, 502, detail="unexpected status")
    retryable = retry.is_retryable_status(status) or (side == "prefill" and status >= 500)
    return _Failure(f"{side}_http_{status}", retryable, status, body)


class ResponseObserver(Protocol):
    """Sees every request's prompt and the text the client received (the integrity monitor)."""

    def started(self, request_id: str, prompt: str, client: str) -> None: ...

    def finished(self, pair: tuple[str, str], request_id: str, prompt: str, outputs: list[str]) -> object: ...

    def released(self, request_id: str) -> None: ...


class _CommittedError(Exception):
    """Internal: the response was handed to the client; nothing more to try."""

    def __init__(self, response: web.StreamResponse) -> None:
        super().__init__("committed")
        self.response = response


class Proxy:
    def __init__(
        self,
        pool: WorkerPool,
        transport: Transport,
        metrics: RouterMetrics,
        retry_cfg: retry.RetryConfig | None = None,
        rng: random.Random | None = None,
        observer: ResponseObserver | None = None,
        on_complete: Callable[[Pair, ProxyRequest, list[str]], None] | None = None,
        resume_cfg: ResumeConfig | None = None,
    ) -> None:
        self.pool = pool
        self.transport = transport
        self.metrics = metrics
        self.retry_cfg = retry_cfg or retry.RetryConfig()
        self.resume_cfg = resume_cfg or ResumeConfig()
        self.rng = rng or random.Random()
        self.observer = observer
        self.on_complete = on_complete  # sees each fully relayed response's texts (shadow comparison)
        self._background: set[asyncio.Task[None]] = set()

    async def handle(self, req: ProxyRequest, http: web.Request) -> web.StreamResponse:
        if self.observer is None:
            return await self._handle(req, http)
        self.observer.started(req.request_id, req.prompt, req.client)
        try:
            return await self._handle(req, http)
        finally:
            self.observer.released(req.request_id)

    async def _handle(self, req: ProxyRequest, http: web.Request) -> web.StreamResponse:
        tried: set[tuple[str, str]] = set()
        failed_workers: set[str] = set()
        attempt = 0
        failure: _Failure | None = None
        while True:
            now = time.monotonic()
            # Prefer a pair without a worker that failed this request, then one this request has not failed on;
            # once all were tried, any pair still admitted.
            pair = (
                self.pool.choose_pair(req.prefix, now, frozenset(tried) | self.pool.pairs_with(failed_workers))
                or self.pool.choose_pair(req.prefix, now, frozenset(tried))
                or self.pool.choose_pair(req.prefix, now)
            )
            if pair is None:
                break
            attempt += 1
            tried.add(pair.key)
            try:
                failure = await self._attempt(pair, req, http)
            except _CommittedError as done:
                return done.response
            if failure.client_error:
                break
            self.metrics.pair_failure(pair, failure.reason)
            failed_workers.add(pair.prefill.key if failure.reason.startswith("prefill") else pair.decode.key)
            if not failure.retryable:
                break
            if not retry.should_retry(attempt, self.retry_cfg, first_byte_sent=False):
                break
            self.metrics.retries.labels(req.route.value, failure.reason).inc()
            log.info(
                "retrying on another pair",
                extra={
                    "request_id": req.request_id,
                    "attempt": attempt,
                    "reason": failure.reason,
                    "prefill": pair.prefill.url,
                    "decode": pair.decode.url,
                },
            )
            await asyncio.sleep(retry.backoff(attempt, self.retry_cfg, self.rng))
        if failure is None:
            return _error(503, "no healthy prefill/decode pair is available", ErrorType.UNAVAILABLE, req.request_id)
        if failure.client_error:
            return web.Response(
                status=failure.status,
                body=client_error_body(failure.status, failure.body or b"", req.body),
                content_type="application/json",
                headers={"X-Request-Id": req.request_id},
            )
        return _error(
            failure.status, f"all {attempt} attempt(s) failed; last: {failure.reason}", ErrorType.SERVER, req.request_id
        )

    async def _attempt(self, pair: Pair, req: ProxyRequest, http: web.Request) -> _Failure:
        """One try on one pair: returns the failure, or raises ``_CommittedError`` with the client's response."""
        ledger = new_ledger(req.route, req.body) if self.resume_cfg.max_attempts else RESUME_OFF
        opened = await self.open_pair(pair, req, ledger.upstream() if isinstance(ledger, StreamLedger) else req.body)
        if isinstance(opened, _Failure):
            return opened
        resp, first = opened
        raise _CommittedError(await self._relay(pair, req, http, resp, first, ledger))

    async def open_pair(
        self, pair: Pair, req: ProxyRequest, request_body: dict[str, Any]
    ) -> tuple[aiohttp.ClientResponse, bytes] | _Failure:
        """Send to both workers of ``pair``: the decode's response and first chunk, or why there is none. On
        success the pair stays dispatched (the caller finishes it) and the prefill is settled in the background."""
        body = bootstrap.inject(
            request_body,
            host=bootstrap.bootstrap_host(pair.prefill.url),
            port=pair.prefill.bootstrap_port,
            items=req.items,
            rng=self.rng,
            dp_size=pair.prefill.attn_dp_size,
        )
        data = orjson.dumps(body)
        # The decode's attention-DP rank goes to the decode alone: a prefill would follow it too, against its room.
        rank = pair.decode_dp_rank
        decode_data = data if rank is None else orjson.dumps({**body, "routed_dp_rank": rank})
        headers = {"Content-Type": "application/json", "X-Request-Id": req.request_id}
        path = req.route.value
        now = time.monotonic()
        self.pool.dispatched(pair, now)
        self.metrics.dispatched(pair)
        prefill_task = asyncio.create_task(self._prefill(pair, path, data, headers))
        decode_task = asyncio.create_task(self._decode_head(pair, path, decode_data, headers, req.stream))
        committed = False
        try:
            done, _ = await asyncio.wait({prefill_task, decode_task}, return_when=asyncio.FIRST_COMPLETED)
            if prefill_task in done and not decode_task.done():
                prefill_failure = prefill_task.result()
                if prefill_failure is not None:
                    decode_task.cancel()
                    return self._failed(pair, prefill_failure, prefill_side=True)
            head = await decode_task
            if isinstance(head, _Failure):
                if head.retryable and prefill_task.done():
                    # The prefill's own refusal explains the decode's failure: the client's mistake, not the pair's.
                    prefill_failure = prefill_task.result()
                    if prefill_failure is not None and prefill_failure.client_error:
                        return prefill_failure
                prefill_task.cancel()
                return self._failed(pair, head, prefill_side=False)
            committed = True
            self._finish_prefill_later(pair, prefill_task)
            return head
        finally:
            self.pool.prefilled(pair)  # the decode's first chunk follows the prefill's KV, or the attempt is over
            if not committed:
                for task in (prefill_task, decode_task):
                    task.cancel()
                self.pool.finished(pair)

    async def _prefill(self, pair: Pair, path: str, data: bytes, headers: Mapping[str, str]) -> _Failure | None:
        """Send to the prefill and drain its body: None when it finished (its KV transfer succeeded)."""
        try:
            resp = await self.transport.open_post(pair.prefill.url, path, data, headers)
            async with resp:
                body = await resp.read()
                if resp.status >= 400:
                    return _http_failure("prefill", resp.status, body)
                return None
        except WorkerUnreachableError as err:
            return _Failure("prefill_unreachable", True, detail=str(err))
        except (TimeoutError, WorkerError, aiohttp.ClientError) as err:
            return _Failure("prefill_transport", True, detail=str(err))

    async def _decode_head(
        self, pair: Pair, path: str, data: bytes, headers: Mapping[str, str], stream: bool
    ) -> tuple[aiohttp.ClientResponse, bytes] | _Failure:
        """The decode's response head and its first chunk (the whole body when not streaming)."""
        try:
            resp = await self.transport.open_post(pair.decode.url, path, data, headers)
        except WorkerUnreachableError as err:
            return _Failure("decode_unreachable", True, detail=str(err))
        except WorkerError as err:
            return _Failure("decode_transport", True, detail=str(err))
        try:
            if resp.status != 200:
                body = await resp.read()
                resp.release()
                return _http_failure("decode", resp.status, body)
            first = await resp.content.readany() if stream else await resp.read()
            if stream and (not first or first.startswith(_ERROR_EVENT)):
                # An empty stream or an error event before any token (e.g. the KV transfer failed): nothing has
                # reached the client yet, so this is retryable like an HTTP error, unless the event is a 4xx.
                resp.close()
                status = stream_error_status(first)
                if status is not None and status < 500 and not retry.is_retryable_status(status):
                    return _Failure("decode_stream_error", False, status, first.split(b"\n\n", 1)[0][6:])
                return _Failure("decode_stream_error", True, detail=first[:300].decode(errors="replace"))
            return resp, first
        except (TimeoutError, aiohttp.ClientError) as err:
            resp.close()
            return _Failure("decode_transport", True, detail=str(err))
        except asyncio.CancelledError:
            resp.close()
            raise

    def _failed(self, pair: Pair, failure: _Failure, *, prefill_side: bool) -> _Failure:
        now = time.monotonic()
        worker = pair.prefill if prefill_side else pair.decode
        hard = failure.reason.endswith("unreachable")
        if failure.retryable:
            self.pool.record_worker(worker, False, now, hard=hard)
            self.pool.record_pair(pair, False, now)
        return failure

    def _finish_prefill_later(self, pair: Pair, task: asyncio.Task[_Failure | None]) -> None:
        """The prefill's outcome still scores the pair, but nobody waits for it."""

        async def settle() -> None:
            failure = await task
            now = time.monotonic()
            if failure is None:
                self.pool.record_worker(pair.prefill, True, now)
            elif not failure.client_error:
                self._failed(pair, failure, prefill_side=True)
                self.metrics.pair_failure(pair, failure.reason)

        bg = asyncio.create_task(settle())
        self._background.add(bg)
        bg.add_done_callback(self._background.discard)

    async def _relay(
        self,
        pair: Pair,
        req: ProxyRequest,
        http: web.Request,
        resp: aiohttp.ClientResponse,
        first: bytes,
        ledger: StreamLedger | Refusal,
    ) -> web.StreamResponse:
        if req.stream:
            return await StreamRelay(self, req, http, ledger).run(pair, resp, first)
        route = req.route.value
        try:
            if self.observer is not None:
                self.report_texts(pair, req, body_texts(route, first))
            self.metrics.ttft.labels(route).observe(time.monotonic() - req.started)
            return web.Response(
                body=conform_body(req.route, first),
                status=200,
                headers={
                    "Content-Type": resp.headers.get("Content-Type", "application/json"),
                    "X-Request-Id": req.request_id,
                },
            )
        finally:
            self.settle(pair, resp, ok=True, client_gone=False)
            self.metrics.e2e.labels(route).observe(time.monotonic() - req.started)

    def settle(self, pair: Pair, resp: aiohttp.ClientResponse, *, ok: bool, client_gone: bool) -> None:
        """A relay from ``pair`` ended: its connection released (closed unless clean), the pair scored."""
        if ok:
            resp.release()
        else:
            resp.close()
        self.pool.finished(pair)
        now = time.monotonic()
        if not client_gone:
            self.pool.record_worker(pair.decode, ok, now)
            self.pool.record_pair(pair, ok, now)

    def report_texts(self, pair: Pair, req: ProxyRequest, texts: list[str]) -> None:
        if self.observer is not None:
            self.observer.finished(pair.key, req.request_id, req.prompt, texts)
        if self.on_complete is not None:
            self.on_complete(pair, req, texts)

    async def drain_background(self) -> None:
        if self._background:
            await asyncio.gather(*self._background, return_exceptions=True)


def _error(status: int, message: str, type_: ErrorType, request_id: str) -> web.Response:
    return web.Response(
        status=status,
        body=error_body(message, type_),
        content_type="application/json",
        headers={"X-Request-Id": request_id},
    )
