"""Relaying one stream to the client, and resuming it on a fresh pair when its pair fails after the first byte.

A stream whose request is resumable (``resume.new_ledger``) is relayed through a ``StreamLedger``. When the decode's
stream breaks (its worker died, or the connection to it did), the relay picks a fresh pair that contains neither
worker that failed this stream, sends it the continuation (``StreamLedger.continuation``) like any request
(prefill and decode at once, fresh bootstrap room) and relays its stream in place of the old one. A continuation
that fails before its first byte (e.g. its prefill dies during the KV transfer) marks that side's worker failed
too and the next pair is tried. At most ``ResumeConfig.max_attempts`` pairs per stream, within
``deadline_s`` of the first break; after that, or for a stream that is not resumable, the client gets the OpenAI
error event, which says why the stream was not resumed.
"""

from __future__ import annotations

import contextlib
import functools
import logging
import time

from tandem_router.dispatch import Dispatch, Opened, ProxyRequest
from tandem_router.integrity.textextract import StreamTexts
from tandem_router.openai.responses import StreamConformer, conformed
from tandem_router.openai.schema import Route, stream_error_event
from tandem_router.pool import Pair
from tandem_router.resume import Refusal, ResumeConfig, StreamLedger
from tandem_router.server import ResponseStream, ServerRequest
from tandem_router.transport import WorkerError, WorkerResponse

log = logging.getLogger("tandem.router.proxy")


class StreamRelay:
    def __init__(
        self,
        dispatch: Dispatch,
        resume_cfg: ResumeConfig,
        req: ProxyRequest,
        http: ServerRequest,
        ledger: StreamLedger | Refusal,
    ) -> None:
        self.dispatch = dispatch
        self.resume_cfg = resume_cfg
        self.req = req
        self.http = http
        self.ledger = ledger if isinstance(ledger, StreamLedger) else None
        self.refusal: Refusal | None = ledger if isinstance(ledger, Refusal) else None  # why a break is final
        self.texts = StreamTexts(req.parsed.route.value) if dispatch.observer is not None else None
        if self.texts is not None and self.ledger is not None:
            self.ledger.on_event = self.texts.add  # the ledger parses every event: the texts come with it
        self.shaped = StreamConformer(req.parsed.route) if req.parsed.route is not Route.GENERATE else None
        if self.shaped is not None and self.ledger is not None:
            self.ledger.conform = functools.partial(conformed, req.parsed.route, stream=True)  # on the ledger's parse
            self.shaped = None
        self.attempts = 0
        self.failed_workers: set[str] = set()

    def _client_bytes(self, raw: bytes) -> bytes:
        if self.ledger is not None:
            raw = self.ledger.feed(raw)
        elif self.texts is not None:
            self.texts.feed(raw)
        return raw if self.shaped is None else self.shaped.feed(raw)

    async def run(self, opened: Opened) -> ResponseStream:
        dispatch, req = self.dispatch, self.req
        pair, resp, first = opened.pair, opened.resp, opened.first
        route = req.parsed.route.value
        metrics = dispatch.metrics
        out = self.http.stream(
            (("Content-Type", "text/event-stream"), ("Cache-Control", "no-cache"), ("X-Request-Id", req.request_id))
        )
        ok = client_gone = False
        settled = False
        try:
            try:
                await out.prepare()
                ended = await self._forward(out, resp, first)
            except ConnectionResetError:
                client_gone = True
                return out
            last = time.monotonic()
            metrics.route_ttft(route).observe(last - req.started)
            itl = metrics.route_itl(route)
            while True:
                error: WorkerError | None = None
                while not ended:  # the decode's chunks, read directly (no async generator between it and the client)
                    try:
                        chunk = await resp.next_chunk()
                    except WorkerError as err:
                        error = err
                        break
                    try:
                        ended = await self._forward(out, resp, chunk)
                    except ConnectionResetError:
                        client_gone = True  # the client left: stop the decode (closing its connection aborts it)
                        return out
                    if chunk:
                        now = time.monotonic()
                        itl.observe(now - last)
                        last = now
                if error is None:
                    ok = True
                    if self.texts is not None:
                        dispatch.report_texts(pair, req, self.texts.texts())
                    break
                metrics.pair_failure(pair, "decode_stream_broken")
                log.warning(
                    "decode stream broke after the first byte",
                    extra={"request_id": req.request_id, "decode": pair.decode.url, "error": repr(error)},
                )
                dispatch.settle(opened, ok=False, client_gone=False)
                settled = True
                resumed = await self._resume(pair, time.monotonic())
                if resumed is None:
                    metrics.stream_errors.labels(route).inc()
                    message = f"decode worker stream failed: {type(error).__name__}; not resumed: {self._why_not()}"
                    with contextlib.suppress(ConnectionResetError):
                        await out.write(stream_error_event(message))
                    break
                opened = resumed
                pair, resp, first = opened.pair, opened.resp, opened.first
                settled = False
                try:
                    ended = await self._forward(out, resp, first)
                except ConnectionResetError:
                    client_gone = True
                    return out
                last = time.monotonic()
            with contextlib.suppress(ConnectionResetError):
                await out.write_eof()  # after an error event (a stream that ended has ended its response)
            return out
        finally:
            if not settled:  # a client that left (also: its request cancelled) says nothing about the pair
                dispatch.settle(opened, ok=ok, client_gone=client_gone or out.client_gone)
            metrics.route_e2e(route).observe(time.monotonic() - req.started)

    async def _forward(self, out: ResponseStream, resp: WorkerResponse, raw: bytes) -> bool:
        """Relay the worker's bytes ``raw`` to the client; True: the worker's stream is over, and so is the response.

        When the worker's response has already ended (its last bytes and its end arrived together, or the whole
        stream at once), the client's last bytes and the end of the response go out in one write: one send instead
        of two, and nothing is held back. The worker's stream was read to its end then, so a client that left
        during that write does not fail it (``ConnectionResetError`` is raised only for bytes the worker has more
        of)."""
        data = self._client_bytes(raw) if raw else b""
        if not resp.ended:
            await out.write(data)
            return False
        if self.shaped is not None:
            data += self.shaped.flush()
        with contextlib.suppress(ConnectionResetError):
            await out.write_eof(data)
        return True

    async def _resume(self, failed: Pair, broke_at: float) -> Opened | None:
        """A fresh pair's continuation of the stream (its response and first chunk), or None: give up."""
        dispatch, req, ledger = self.dispatch, self.req, self.ledger
        self.refusal = self.refusal if ledger is None else ledger.refusal
        if ledger is None or self.refusal is not None:
            return None
        self.failed_workers.add(failed.decode.key)
        reason = "decode_stream_broken"
        deadline = broke_at + self.resume_cfg.deadline_s
        while self.attempts < self.resume_cfg.max_attempts and time.monotonic() < deadline:
            now = time.monotonic()
            # Never a failed worker, and only the broken pair's revision: the relayed tokens came from that model.
            other_revision = {p.key for p in dispatch.pool.all_pairs() if p.prefill.revision != failed.prefill.revision}
            exclude = dispatch.pool.pairs_with(self.failed_workers) | other_revision
            pair = dispatch.pool.choose_pair(req.prefix, now, exclude)
            if pair is None:
                return None
            self.attempts += 1
            ledger.next_segment()
            opened = await dispatch.open_pair(pair, req, ledger.continuation())
            if isinstance(opened, Opened):
                dispatch.metrics.resumed.labels(req.parsed.route.value, reason).inc()
                dispatch.metrics.resume_gap.observe(time.monotonic() - broke_at)
                log.info(
                    "resumed the stream on a fresh pair",
                    extra={
                        "request_id": req.request_id,
                        "attempt": self.attempts,
                        "relayed_tokens": ledger.sent_tokens,
                        "old_prefill": failed.prefill.url,
                        "old_decode": failed.decode.url,
                        "prefill": pair.prefill.url,
                        "decode": pair.decode.url,
                    },
                )
                return opened
            if opened.client_error:
                self.refusal = Refusal(
                    "continuation_refused", f"a fresh pair refused the continuation ({opened.status})"
                )
                return None
            dispatch.metrics.pair_failure(pair, opened.reason)
            self.failed_workers.add(pair.prefill.key if opened.reason.startswith("prefill") else pair.decode.key)
            failed, reason = pair, opened.reason
        return None

    def _why_not(self) -> str:
        """Why the broken stream was not resumed (the error event says it; the metric counts it)."""
        if self.refusal is not None:
            code, why = self.refusal.code, self.refusal.why
        elif self.attempts >= self.resume_cfg.max_attempts:
            code, why = "attempts", f"{self.attempts} fresh pair(s) tried, none continued it"
        else:
            code, why = "no_pair", "no fresh pair of its revision was available in time"
        self.dispatch.metrics.resume_refused.labels(self.req.parsed.route.value, code).inc()
        log.warning("stream not resumed", extra={"request_id": self.req.request_id, "reason": code, "why": why})
        return why
