"""The Kubernetes REST client of the operator and the router: one aiohttp session (the HTTP stack kopf already uses)
that sends a ``Request`` as JSON and returns the decoded answer, or streams a watch's events.

It replaces ``kubernetes_asyncio``'s ApiClient (whose import alone was ~40 MiB of the operator's RSS) and keeps
its wire behaviour: ``Accept: application/json``, the body as JSON whatever the content type (JSON is YAML, so an
apply patch too), up to ``CONNECTIONS`` connections, the proxy environment honoured, an error status raised as
``ApiError``. One difference: a request gives up after ``TIMEOUT_S`` (kubernetes_asyncio set none; kopf's own
requests use the same 30 s). Retries and the mapping to the operator's errors live in
``tandem_operator.act.k8s.kube``; list-then-watch in ``tandem.kube.watch``.

Development tooling and the tests keep ``kubernetes_asyncio``: a test drives the cluster with an independent
client, so a bug in this one is not mirrored by the test's own calls.
"""

from __future__ import annotations

import contextlib
import json
from collections.abc import AsyncIterator
from dataclasses import dataclass
from types import TracebackType
from typing import Any

import aiohttp

from tandem.kube.credentials import Credentials

CONNECTIONS = 100  # kubernetes_asyncio's connection_pool_maxsize
TIMEOUT_S = 30.0
USER_AGENT = "tandem"


@dataclass(frozen=True)
class Request:
    method: str
    path: str
    query: tuple[tuple[str, str], ...]
    headers: dict[str, str]
    body: dict[str, Any] | None


class ApiError(Exception):
    """An error status from the API server; ``message`` is its Status object's, when it sent one."""

    def __init__(self, status: int, reason: str, message: str = "") -> None:
        super().__init__(f"{status} {reason}" + (f": {message}" if message else ""))
        self.status, self.reason, self.message = status, reason, message


def _status_message(data: bytes) -> str:
    try:
        status = json.loads(data)
    except ValueError:
        return ""
    return str(status.get("message") or "") if isinstance(status, dict) else ""


class RestClient:
    """``async with RestClient(credentials) as rest: await rest.send(request)``."""

    def __init__(self, credentials: Credentials, *, timeout_s: float = TIMEOUT_S, user_agent: str = USER_AGENT) -> None:
        self.credentials, self.timeout_s, self.user_agent = credentials, timeout_s, user_agent
        self._session: aiohttp.ClientSession | None = None

    async def __aenter__(self) -> RestClient:
        self._session = aiohttp.ClientSession(
            connector=aiohttp.TCPConnector(limit=CONNECTIONS, ssl=self.credentials.ssl_context()),
            timeout=aiohttp.ClientTimeout(total=self.timeout_s),
            headers={"Accept": "application/json", "User-Agent": self.user_agent},
            trust_env=True,
        )
        return self

    async def __aexit__(
        self, exc_type: type[BaseException] | None, exc: BaseException | None, tb: TracebackType | None
    ) -> None:
        if self._session is not None:
            await self._session.close()
            self._session = None

    async def send(self, request: Request) -> Any:
        """The decoded JSON answer (None for an empty body); raises ``ApiError`` on an error status and
        ``aiohttp.ClientError`` / ``TimeoutError`` when the connection fails."""
        async with self._response(request, self.timeout_s) as response:
            body = await response.read()
        return json.loads(body) if body else None

    async def lines(self, request: Request, *, timeout_s: float) -> AsyncIterator[Any]:
        """Each line of a streaming answer (a watch's events), decoded, until the server ends it; raises as ``send``
        does, and gives up after ``timeout_s`` in all. Lines are split here rather than by aiohttp's ``readline``,
        whose buffer limit (128 KiB) a large object would exceed."""
        async with self._response(request, timeout_s) as response:
            pending = b""
            async for chunk in response.content.iter_any():
                *complete, pending = (pending + chunk).split(b"\n")
                for line in complete:
                    if line.strip():
                        yield json.loads(line)
            if pending.strip():
                yield json.loads(pending)

    @contextlib.asynccontextmanager
    async def _response(self, request: Request, timeout_s: float) -> AsyncIterator[aiohttp.ClientResponse]:
        """The response to ``request`` once its status is a success (else ``ApiError``)."""
        if self._session is None:
            raise RuntimeError("RestClient used outside its async with block")
        headers = dict(request.headers)
        token = self.credentials.bearer_token()
        if token:
            headers["Authorization"] = f"Bearer {token}"
        data = json.dumps(request.body).encode() if request.body is not None else None
        if data is not None:
            headers.setdefault("Content-Type", "application/json")
        async with self._session.request(
            request.method,
            self.credentials.server + request.path,
            params=list(request.query),
            data=data,
            headers=headers,
            timeout=aiohttp.ClientTimeout(total=timeout_s),
        ) as response:
            if not 200 <= response.status <= 299:
                raise ApiError(response.status, response.reason or "", _status_message(await response.read()))
            yield response
