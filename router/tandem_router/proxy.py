"""One client request through a prefill/decode pair: send to both at once, relay decode, retry before byte 1.

Per attempt: pick a pair (pool) and send to it (``dispatch``: fresh bootstrap fields, the same body to the
prefill and the decode concurrently; the decode's first chunk is relayed as soon as it arrives). Until a byte
reached the client, a transport error or a retryable status on either side moves the request to another pair
with a new room. After that, a failure resumes the stream on a fresh pair where it can (``stream_relay``), else
ends it with an OpenAI error event. A worker's 4xx (other than 408/429), from whichever side answers first, is
the client's mistake: the other side is cancelled, nothing is retried or counted against the pair, and the
client gets the worker's message as an OpenAI error with the same status.
"""

from __future__ import annotations

import asyncio
import logging
import random
import time
from collections.abc import Callable

from tandem_router.dispatch import Dispatch, Failure, Opened, ProxyRequest, ResponseObserver
from tandem_router.integrity.textextract import body_texts
from tandem_router.metrics import RouterMetrics
from tandem_router.openai.errors import client_error_body
from tandem_router.openai.responses import conform_body
from tandem_router.openai.schema import ErrorType, error_body
from tandem_router.policy import retry
from tandem_router.pool import Pair, WorkerPool
from tandem_router.resume import RESUME_OFF, Refusal, ResumeConfig, StreamLedger, new_ledger
from tandem_router.server import Reply, Response, ServerRequest
from tandem_router.stream_relay import StreamRelay
from tandem_router.transport import Transport

log = logging.getLogger("tandem.router.proxy")

FABRIC_REFUSAL = (
    "no prefill/decode pair within one RDMA fabric domain is available (fabric locality required: healthy pairs "
    "exist only across domains)"
)


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
        self.metrics = metrics
        self.retry_cfg = retry_cfg or retry.RetryConfig()
        self.resume_cfg = resume_cfg or ResumeConfig()
        self.rng = rng or random.Random()
        self.observer = observer
        self.dispatch = Dispatch(pool, transport, metrics, self.rng, observer, on_complete)

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
        failure: Failure | None = None
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
            if not isinstance(outcome, Failure):
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
            self.metrics.retries.labels(req.parsed.route.value, failure.reason).inc()
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
            self.metrics.fabric_refused(req.parsed.route)
            return _error(503, FABRIC_REFUSAL, ErrorType.UNAVAILABLE, req.request_id, code="no_fabric_local_pair")
        if failure is None:
            return _error(503, "no healthy prefill/decode pair is available", ErrorType.UNAVAILABLE, req.request_id)
        if failure.client_error:
            return Reply(
                client_error_body(failure.status, failure.body or b"", req.parsed.body),
                status=failure.status,
                headers=(("X-Request-Id", req.request_id),),
            )
        return _error(
            failure.status, f"all {attempt} attempt(s) failed; last: {failure.reason}", ErrorType.SERVER, req.request_id
        )

    async def _attempt(self, pair: Pair, req: ProxyRequest, http: ServerRequest) -> Response | Failure:
        """One try on one pair: the client's response once relayed, or why this pair could not serve it."""
        ledger = new_ledger(req.parsed) if self.resume_cfg.max_attempts else RESUME_OFF
        body = ledger.upstream() if isinstance(ledger, StreamLedger) else req.parsed.body
        opened = await self.dispatch.open_pair(pair, req, body)
        if isinstance(opened, Failure):
            return opened
        return await self._relay(opened, req, http, ledger)

    async def _relay(
        self, opened: Opened, req: ProxyRequest, http: ServerRequest, ledger: StreamLedger | Refusal
    ) -> Response:
        if req.parsed.stream:
            return await StreamRelay(self.dispatch, self.resume_cfg, req, http, ledger).run(opened)
        route = req.parsed.route.value
        try:
            if self.observer is not None:
                self.dispatch.report_texts(opened.pair, req, body_texts(route, opened.first))
            self.metrics.route_ttft(route).observe(time.monotonic() - req.started)
            return Reply(
                conform_body(req.parsed.route, opened.first),
                content_type=opened.resp.headers.get("content-type", "application/json"),
                headers=(("X-Request-Id", req.request_id),),
            )
        finally:
            self.dispatch.settle(opened, ok=True, client_gone=False)
            self.metrics.route_e2e(route).observe(time.monotonic() - req.started)


def _error(status: int, message: str, type_: ErrorType, request_id: str, *, code: str | None = None) -> Reply:
    return Reply(error_body(message, type_, code=code), status=status, headers=(("X-Request-Id", request_id),))
