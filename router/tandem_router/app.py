"""The router's HTTP surface: routes, validation, auth, limits, request ids, metrics; the proxy does the rest.

Served by the router's own HTTP/1.1 server (``server``). Every failure a client can see is an OpenAI error body.
Invalid requests are rejected here, before anything is sent to a worker.
"""

from __future__ import annotations

import asyncio
import functools
import logging
import os
import time
from collections.abc import Awaitable, Callable
from dataclasses import dataclass, field

import orjson
import pydantic
from prometheus_client import CONTENT_TYPE_LATEST, CollectorRegistry, generate_latest

from tandem_router.config import DiscoveryMode, RouterSettings
from tandem_router.discovery import Discovery, make_discovery
from tandem_router.dispatch import ProxyRequest
from tandem_router.flow.requests import estimated_tokens
from tandem_router.flow_control import FlowControl
from tandem_router.health import HealthChecker
from tandem_router.integrity.monitor import IntegrityConfig, IntegrityMonitor
from tandem_router.integrity.quarantine import QuarantinePolicy
from tandem_router.metrics import RouterMetrics
from tandem_router.openai.openapi import document
from tandem_router.openai.requests import ParsedRequest, canonical, param_path, refusal
from tandem_router.openai.schema import (
    ROUTES,
    ErrorType,
    ModelCard,
    ModelList,
    Route,
    error_body,
    prompt_text,
    routing_key,
)
from tandem_router.policy.breaker import BreakerConfig
from tandem_router.policy.retry import RetryConfig
from tandem_router.pool import PairGate, WorkerPool
from tandem_router.probes.canary import CanaryConfig, ProbeScope
from tandem_router.probes.hooks import IntegrityHooks, build_hooks, probing_capacity
from tandem_router.probes.members import RouterMembers, router_id
from tandem_router.probes.publisher import IntegrityPublisher, integrity_document
from tandem_router.proxy import Proxy
from tandem_router.resume import ResumeConfig
from tandem_router.server import HttpServer, Limits, Reply, Response, ServerRequest
from tandem_router.tenants import client_identity
from tandem_router.transport import Transport, TransportConfig

log = logging.getLogger("tandem.router")

Endpoint = Callable[[ServerRequest], Awaitable[Response]]
_PROXIED = frozenset(r.value for r in Route)
PROMPT_CHARS_INSPECTED = 65536  # prompt text kept for the prompt-leak detector, per request
PREFIX_UNITS = 32768  # prompt prefix (characters or token ids) that keys cache-aware prefill choice


@dataclass
class RouterState:
    settings: RouterSettings
    pool: WorkerPool
    transport: Transport
    metrics: RouterMetrics
    proxy: Proxy
    health: HealthChecker
    discovery: Discovery
    integrity: IntegrityMonitor | None = None
    hooks: IntegrityHooks | None = None
    flow: FlowControl | None = None
    members: RouterMembers | None = None  # the cluster's routers, for splitting canary rounds (etcd discovery)
    background: list[asyncio.Task[None]] = field(default_factory=list)
    stop: asyncio.Event = field(default_factory=asyncio.Event)
    in_flight: int = 0
    draining: bool = False
    openapi: bytes = field(default_factory=lambda: orjson.dumps(document()))


def error(
    status: int,
    message: str,
    type_: ErrorType,
    *,
    code: str | None = None,
    param: str | None = None,
    headers: tuple[tuple[str, str], ...] = (),
) -> Reply:
    return Reply(error_body(message, type_, code=code, param=param), status=status, headers=headers)


def integrity_config(settings: RouterSettings) -> IntegrityConfig:
    s = settings.integrity
    return IntegrityConfig(
        enabled=s.enabled,
        leak_ngram=s.leak_ngram_words,
        independent_clients=s.independent_clients,
        near_tie_nats=s.near_tie_nats,
        policy=QuarantinePolicy(
            threshold=s.quarantine_threshold,
            window_s=s.quarantine_window_s,
            probe_initial_s=s.quarantine_probe_initial_s,
            probe_max_s=max(s.quarantine_probe_max_s, s.quarantine_probe_initial_s),
            comparisons_to_release=s.probation_comparisons,
            watch_s=s.quarantine_watch_s,
            max_detector_share=s.max_detector_ejection_share,
            report_after=s.report_after_quarantines,
        ),
    )


def build_app(settings: RouterSettings, gates: tuple[PairGate, ...] = ()) -> RouterApp:
    transport = Transport(TransportConfig(settings.connect_timeout_s, settings.read_idle_timeout_s))
    monitor: IntegrityMonitor | None = None
    extra_gates: tuple[PairGate, ...] = gates
    if settings.integrity.enabled:
        monitor = IntegrityMonitor(integrity_config(settings), CollectorRegistry())
        extra_gates = (*gates, monitor)
    pool = WorkerPool(
        settings.policy,
        BreakerConfig(settings.breaker_threshold, settings.breaker_cooldown_s),
        gates=extra_gates,
        cache_cfg=settings.cache_aware.config,
        fabric=settings.fabric_locality,
    )
    metrics = RouterMetrics(pool)
    retry_cfg = RetryConfig(settings.retry.max_attempts, settings.retry.initial_backoff_s)
    canary_cfg = CanaryConfig(interval_s=settings.integrity.canary_interval_s, sample=settings.integrity.canary_sample)
    flow = FlowControl(settings, pool, metrics.registry) if settings.flow_control.enabled else None
    me = router_id()
    members = (
        RouterMembers(
            me,
            settings.etcd.endpoints,
            settings.cluster_namespace,
            settings.cluster_name,
            tls=settings.etcd.tls,
        )
        if monitor is not None and settings.discovery is DiscoveryMode.ETCD
        else None
    )
    hooks = None
    if monitor is not None:
        hooks = build_hooks(
            monitor,
            transport,
            pool,
            canary_cfg,
            settings.integrity.shadow_rate,
            budget_share=settings.integrity.probe_budget_share,
            capacity=lambda: probing_capacity(pool, flow),
            scope=ProbeScope(me, lambda: {me}, monitor.probe_first)
            if members is None
            else ProbeScope(me, members.ids, monitor.probe_first, members.peer_quarantined),
        )
    state = RouterState(
        settings,
        pool,
        transport,
        metrics,
        Proxy(
            pool,
            transport,
            metrics,
            retry_cfg,
            observer=monitor,
            on_complete=hooks.completed if hooks is not None else None,
            resume_cfg=ResumeConfig(settings.retry.resume_max_attempts, settings.retry.resume_deadline_s),
        ),
        HealthChecker(pool, transport, settings.health_interval_s),
        make_discovery(pool, settings),
    )
    state.integrity, state.hooks, state.flow, state.members = monitor, hooks, flow, members
    return RouterApp(state)


class RouterApp:
    """The routes and the router's lifecycle: ``start`` (discovery, health checks, background tasks, then the
    listener) and ``stop`` (listener closed, in-flight requests drained, then everything else)."""

    def __init__(self, state: RouterState) -> None:
        self.state = state
        proxied = {r.value: {"POST": _proxied(state, r)} for r in Route}
        plain = {
            "/v1/models": _models,
            "/health": _health,
            "/readiness": _readiness,
            "/metrics": _metrics,
            "/openapi.json": _openapi,
            "/integrity": _integrity,
        }
        self.routes: dict[str, dict[str, Endpoint]] = proxied
        for path, endpoint in plain.items():
            bound = functools.partial(endpoint, state)
            self.routes[path] = {"GET": bound, "HEAD": bound}

    async def handle(self, request: ServerRequest) -> Response:
        path = request.path
        methods = self.routes.get(path)
        if methods is None:
            return error(404, "Not Found", ErrorType.NOT_FOUND)
        endpoint = methods.get(request.method)
        if endpoint is None:
            return error(405, "Method Not Allowed", ErrorType.INVALID_REQUEST, headers=(("Allow", ",".join(methods)),))
        s = self.state
        proxied = path in _PROXIED
        resp: Response
        if s.settings.api_keys and (proxied or path == "/v1/models") and not _authorized(request, s.settings):
            resp = error(
                401,
                "missing or invalid API key (Authorization: Bearer <key>)",
                ErrorType.AUTHENTICATION,
                code="invalid_api_key",
            )
        else:
            try:
                resp = await endpoint(request)
            except asyncio.CancelledError:
                raise
            except Exception:
                log.exception("unhandled error", extra={"path": path})
                resp = error(500, "internal router error", ErrorType.SERVER)
        if proxied:
            s.metrics.route_requests(path, str(resp.status)).inc()
        return resp

    async def start(self, host: str, port: int, *, reuse_port: bool = False) -> HttpServer:
        await _startup(self.state)
        server = HttpServer(self.handle, Limits(max_body_bytes=self.state.settings.max_body_bytes))
        await server.start(host, port, reuse_port=reuse_port)
        return server

    async def stop(self, server: HttpServer, drain_timeout_s: float) -> None:
        """New connections are refused; in-flight requests get ``drain_timeout_s``."""
        self.state.draining = True
        await server.drain(drain_timeout_s)
        await _cleanup(self.state)


def state_of(app: RouterApp) -> RouterState:
    return app.state


async def _startup(s: RouterState) -> None:
    await s.discovery.start()
    await s.health.check_all()
    s.health.start()
    if s.hooks is not None:
        s.background.append(asyncio.create_task(s.hooks.canary.run(s.stop)))
    if s.flow is not None:
        s.background.append(asyncio.create_task(s.flow.run(s.stop)))
    if s.integrity is not None and s.members is not None:
        s.members.start()
        publisher = IntegrityPublisher(
            s.integrity,
            s.settings.etcd.endpoints,
            s.settings.cluster_namespace,
            s.settings.cluster_name,
            s.members.me,
            tls=s.settings.etcd.tls,
        )
        s.background.append(asyncio.create_task(publisher.run(s.stop)))


async def _cleanup(s: RouterState) -> None:
    s.stop.set()
    await asyncio.gather(*s.background, return_exceptions=True)
    if s.hooks is not None:
        await s.hooks.drain()
    await s.health.stop()
    if s.members is not None:
        await s.members.stop()
    await s.discovery.stop()
    await s.proxy.dispatch.drain_background()
    await s.transport.close()


def _authorized(request: ServerRequest, settings: RouterSettings) -> bool:
    header = request.header("authorization")
    token = header[7:] if header[:7].lower() == "bearer " else ""
    return token in settings.api_keys


def _proxied(state: RouterState, route: Route) -> Endpoint:
    """The handler of a proxied route (the request body's size limit is the server's: ``Limits``)."""
    model_cls = ROUTES[route].model

    async def handle(request: ServerRequest) -> Response:
        s = state
        if s.draining:
            return error(503, "router is shutting down", ErrorType.UNAVAILABLE)
        if s.in_flight >= s.settings.max_concurrent_requests:
            return error(429, "too many concurrent requests", ErrorType.RATE_LIMIT, headers=(("Retry-After", "1"),))
        started = time.monotonic()
        parsed = _parse(request.body, route, model_cls)
        if isinstance(parsed, Reply):
            return parsed
        model = parsed.model
        if model is not None and not s.pool.serves(model, s.settings.model_names):
            return error(
                404, f"The model '{model}' does not exist", ErrorType.NOT_FOUND, code="model_not_found", param="model"
            )
        body = parsed.body
        # One pass over the prompt: the routing prefix is its start (and all of it the leak detector needs).
        prompt = prompt_text(route, body, limit=PROMPT_CHARS_INSPECTED if s.integrity is not None else PREFIX_UNITS)
        client = client_identity(request, s.settings)
        s.in_flight += 1  # queued requests count too: max_concurrent_requests bounds what the router holds
        flow, slot = s.flow, None
        try:
            if flow is not None:
                admitted = await flow.enter(client, parsed.priority, estimated_tokens(parsed, len(prompt)))
                if isinstance(admitted, Reply):
                    return admitted
                slot = admitted
                if s.settings.flow_control.worker_priority:
                    parsed = parsed.with_priority(slot.priority)
            req = ProxyRequest(
                parsed=parsed,
                prefix=routing_key(route, body, prompt, PREFIX_UNITS),
                prompt=prompt if s.integrity is not None else "",
                request_id=request.header("x-request-id")
                or os.urandom(16).hex(),  # 32 hex digits, as uuid4().hex, for less work
                started=started,
                client=client,
            )
            return await s.proxy.handle(req, request)
        finally:
            s.in_flight -= 1
            if flow is not None and slot is not None:
                flow.leave(slot)

    return handle


def _parse(raw: bytes, route: Route, model_cls: type[pydantic.BaseModel]) -> ParsedRequest | Reply:
    """The request with its canonical body to forward (``openai.requests.canonical``) and the facts the router
    decides on, read once (``ParsedRequest``); or the OpenAI error that refuses it."""
    try:
        body = orjson.loads(raw)
    except orjson.JSONDecodeError as err:
        return error(400, f"request body is not valid JSON: {err}", ErrorType.INVALID_REQUEST)
    if not isinstance(body, dict):
        return error(400, "request body must be a JSON object", ErrorType.INVALID_REQUEST)
    body = canonical(route, body)
    try:
        model_cls.model_validate(body)
    except pydantic.ValidationError as err:
        first = err.errors(include_url=False)[0]
        where = param_path(first["loc"])
        return error(400, f"{where}: {first['msg']}" if where else first["msg"], ErrorType.INVALID_REQUEST, param=where)
    refused = refusal(route, body)
    if refused is not None:
        return error(400, refused.message, ErrorType.INVALID_REQUEST, param=refused.param)
    return ParsedRequest.of(route, body)


async def _models(s: RouterState, request: ServerRequest) -> Response:
    names = sorted(s.pool.models() | set(s.settings.model_names))
    return Reply(ModelList(data=[ModelCard(id=n) for n in names]).model_dump_json().encode())


async def _health(s: RouterState, request: ServerRequest) -> Response:
    return Reply(b"OK", content_type="text/plain; charset=utf-8")


async def _readiness(s: RouterState, request: ServerRequest) -> Response:
    if s.draining:
        return error(503, "draining", ErrorType.UNAVAILABLE)
    now = time.monotonic()
    if not s.pool.has_healthy_pair(now):
        return error(503, "no healthy prefill/decode pair", ErrorType.UNAVAILABLE)
    guard = s.pool.registry_guard
    if guard is not None and guard.panic_since is not None:
        detail = (
            f"OK; registry panic for {now - guard.panic_since:.0f}s: serving {len(guard.held)} worker(s) the "
            "registry removed while their health checks pass"
        )
        return Reply(detail.encode(), content_type="text/plain; charset=utf-8")
    return Reply(b"OK", content_type="text/plain; charset=utf-8")


async def _metrics(s: RouterState, request: ServerRequest) -> Response:
    data = generate_latest(s.metrics.registry)
    if s.integrity is not None:
        data += generate_latest(s.integrity.metrics.registry)
    return Reply(data, content_type=CONTENT_TYPE_LATEST)


async def _integrity(s: RouterState, request: ServerRequest) -> Response:
    """Quarantined pairs (probation included) and why, workers that are out, repeat offenders."""
    doc = {"enabled": False, "quarantined": []} if s.integrity is None else integrity_document(s.integrity)
    return Reply(orjson.dumps(doc))


async def _openapi(s: RouterState, request: ServerRequest) -> Response:
    return Reply(s.openapi)
