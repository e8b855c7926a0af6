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
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any, Protocol

import orjson

from tandem.registry import Role
from tandem_router.integrity.textextract import body_texts
from tandem_router.metrics import RouterMetrics
from tandem_router.openai.errors import client_error_body, stream_error_status
from tandem_router.openai.responses import conform_body
from tandem_router.policy import bootstrap, retry
from tandem_router.pool import Lease, Pair, WorkerPool
from tandem_router.resume import RESUME_OFF, Refusal, ResumeConfig, StreamLedger, new_ledger
from tandem_router.schema import ErrorType, Route, error_body
from tandem_router.server import Reply, Response, ServerRequest
from tandem_router.stream_relay import Opened, StreamRelay
from tandem_router.transport import Request, Transport, WorkerError, WorkerResponse

log = logging.getLogger("tandem.router.proxy")

_ERROR_EVENT = b'data: {"error"'
FABRIC_REFUSAL = (
    "no prefill/decode pair within one RDMA fabric domain is available (fabric locality required: healthy pairs "
    "exist only across domains)"
)


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
    hard: bool = False  # the worker is gone (its connection was refused): open its breaker at once

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


def _failed(lease: Lease, failure: _Failure, role: Role) -> _Failure:
    """A failure of ``role``'s side before the first byte: a retryable one scores that worker and the pair."""
    if failure.retryable:
        lease.failed(role, time.monotonic(), hard=failure.hard)
    return failure


def _transport_failure(side: str, err: WorkerError) -> _Failure:
    """No answer from a worker (retryable); a refused connection is hard: the worker is gone."""
    return _Failure(f"{side}_{err.reason.value}", True, hard=err.hard, detail=str(err))


class ResponseObserver(Protocol):
    """Sees every request's prompt and the text the client received (the integrity monitor)."""

    def started(self, request_id: str, prompt: str, client: str) -> None: ...

    def finished(self, pair: tuple[str, str], request_id: str, prompt: str, outputs: list[str]) -> object: ...

    def released(self, request_id: str) -> None: ...


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

    async def handle(self, req: ProxyRequest, http: ServerRequest) -> Response:
        if self.observer is None:
            return await self._handle(req, http)
        self.observer.started(req.request_id, req.prompt, req.client)
        try:
            return await self._handle(req, http)
        finally:
            self.observer.released(req.request_id)

    async def _handle(self, req: ProxyRequest, http: ServerRequest) -> Response:
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
            outcome = await self._attempt(pair, req, http)
            if not isinstance(outcome, _Failure):
                return outcome  # relayed to the client: nothing more to try
            failure = outcome
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
        if failure is None and self.pool.fabric_refuses(time.monotonic()):
            self.metrics.fabric_refused(req.route)
            return _error(503, FABRIC_REFUSAL, ErrorType.UNAVAILABLE, req.request_id, code="no_fabric_local_pair")
        if failure is None:
            return _error(503, "no healthy prefill/decode pair is available", ErrorType.UNAVAILABLE, req.request_id)
        if failure.client_error:
            return Reply(
                client_error_body(failure.status, failure.body or b"", req.body),
                status=failure.status,
                headers=(("X-Request-Id", req.request_id),),
            )
        return _error(
            failure.status, f"all {attempt} attempt(s) failed; last: {failure.reason}", ErrorType.SERVER, req.request_id
        )

    async def _attempt(self, pair: Pair, req: ProxyRequest, http: ServerRequest) -> Response | _Failure:
        """One try on one pair: the client's response once relayed, or why this pair could not serve it."""
        ledger = new_ledger(req.route, req.body) if self.resume_cfg.max_attempts else RESUME_OFF
        opened = await self.open_pair(pair, req, ledger.upstream() if isinstance(ledger, StreamLedger) else req.body)
        if isinstance(opened, _Failure):
            return opened
        return await self._relay(opened, req, http, ledger)

    async def open_pair(self, pair: Pair, req: ProxyRequest, request_body: dict[str, Any]) -> Opened | _Failure:
        """Send to both workers of ``pair``: the decode's response and first chunk, or why there is none. On
        success the pair's lease stays held (``settle`` releases it) and the prefill is settled in the background."""
        body = bootstrap.inject(
            request_body,
            host=bootstrap.bootstrap_host(pair.prefill.url),
            port=pair.prefill.bootstrap_port,
            items=req.items,
            rng=self.rng,
            dp_size=pair.prefill.attn_dp_size,
        )
        headers = {"Content-Type": "application/json", "X-Request-Id": req.request_id}
        request = Request.build("POST", req.route.value, orjson.dumps(body), headers)
        # The decode's attention-DP rank goes to the decode alone: a prefill would follow it too, against its room.
        rank = pair.decode_dp_rank
        decode_request = (
            request
            if rank is None
            else Request.build("POST", req.route.value, orjson.dumps({**body, "routed_dp_rank": rank}), headers)
        )
        lease = self.pool.lease(pair, time.monotonic())
        self.metrics.dispatched(pair)
        # The decode's request goes out first: the client's first byte follows the decode's answer, the prefill's
        # only settles the pair (SGLang's workers pair up through the bootstrap room, whichever arrives first).
        decode_task = asyncio.create_task(self._decode_head(pair, decode_request, req.stream))
        prefill_task = asyncio.create_task(self._prefill(pair, request))
        committed = False
        try:
            done, _ = await asyncio.wait({prefill_task, decode_task}, return_when=asyncio.FIRST_COMPLETED)
            if prefill_task in done and not decode_task.done():
                prefill_failure = prefill_task.result()
                if prefill_failure is not None:
                    decode_task.cancel()
                    return _failed(lease, prefill_failure, Role.PREFILL)
            head = await decode_task
            if isinstance(head, _Failure):
                if head.retryable and prefill_task.done():
                    # The prefill's own refusal explains the decode's failure: the client's mistake, not the pair's.
                    prefill_failure = prefill_task.result()
                    if prefill_failure is not None and prefill_failure.client_error:
                        return prefill_failure
                prefill_task.cancel()
                return _failed(lease, head, Role.DECODE)
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

    async def _prefill(self, pair: Pair, request: Request) -> _Failure | None:
        """Send to the prefill and drain its body: None when it finished (its KV transfer succeeded)."""
        try:
            async with await self.transport.open(pair.prefill.url, request) as resp:
                body = await resp.read()
                if resp.status >= 400:
                    return _http_failure("prefill", resp.status, body)
                return None
        except WorkerError as err:
            return _transport_failure("prefill", err)

    async def _decode_head(self, pair: Pair, request: Request, stream: bool) -> tuple[WorkerResponse, bytes] | _Failure:
        """The decode's response head and its first chunk (the whole body when not streaming)."""
        try:
            resp = await self.transport.open(pair.decode.url, request)
        except WorkerError as err:
            return _transport_failure("decode", err)
        try:
            if resp.status != 200:
                body = await resp.read()
                resp.release()
                return _http_failure("decode", resp.status, body)
            first = await resp.next_chunk() if stream else await resp.read()
            if stream and (not first or first.startswith(_ERROR_EVENT)):
                # An empty stream or an error event before any token (e.g. the KV transfer failed): nothing has
                # reached the client yet, so this is retryable like an HTTP error, unless the event is a 4xx.
                resp.close()
                status = stream_error_status(first)
                if status is not None and status < 500 and not retry.is_retryable_status(status):
                    return _Failure("decode_stream_error", False, status, first.split(b"\n\n", 1)[0][6:])
                return _Failure("decode_stream_error", True, detail=first[:300].decode(errors="replace"))
            return resp, first
        except WorkerError as err:
            resp.close()
            return _transport_failure("decode", err)
        except asyncio.CancelledError:
            resp.close()
            raise

    def _finish_prefill_later(self, lease: Lease, task: asyncio.Task[_Failure | None]) -> None:
        """The prefill's outcome still scores the pair, but nobody waits for it."""

        async def settle() -> None:
            failure = await task
            if failure is None:
                lease.prefill_ok(time.monotonic())
            elif not failure.client_error:
                _failed(lease, failure, Role.PREFILL)
                self.metrics.pair_failure(lease.pair, failure.reason)

        bg = asyncio.create_task(settle())
        self._background.add(bg)
        bg.add_done_callback(self._background.discard)

    async def _relay(
        self, opened: Opened, req: ProxyRequest, http: ServerRequest, ledger: StreamLedger | Refusal
    ) -> Response:
        if req.stream:
            return await StreamRelay(self, req, http, ledger).run(opened)
        route = req.route.value
        try:
            if self.observer is not None:
                self.report_texts(opened.pair, req, body_texts(route, opened.first))
            self.metrics.route_ttft(route).observe(time.monotonic() - req.started)
            return Reply(
                conform_body(req.route, opened.first),
                content_type=opened.resp.headers.get("content-type", "application/json"),
                headers=(("X-Request-Id", req.request_id),),
            )
        finally:
            self.settle(opened, ok=True, client_gone=False)
            self.metrics.route_e2e(route).observe(time.monotonic() - req.started)

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


def _error(status: int, message: str, type_: ErrorType, request_id: str, *, code: str | None = None) -> Reply:
    return Reply(error_body(message, type_, code=code), status=status, headers=(("X-Request-Id", request_id),))
