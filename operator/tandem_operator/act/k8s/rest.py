"""The operator's Kubernetes REST client: one aiohttp session (the HTTP stack kopf already uses) that sends a
``k8s.apply.Request`` as JSON and returns the decoded answer.

It replaces ``kubernetes_asyncio``'s ApiClient (whose import alone was ~40 MiB of the operator's RSS) and keeps
its wire behaviour: ``Accept: application/json``, the body as JSON whatever the content type (JSON is YAML, so an
apply patch too), up to ``CONNECTIONS`` connections, the proxy environment honoured, an error status raised as
``ApiError``. One difference: a request gives up after ``TIMEOUT_S`` (kubernetes_asyncio set none; kopf's own
requests use the same 30 s), which ``kube.Kube`` retries as a lost connection. Retries and the mapping to the
operator's errors live in ``kube.Kube``.
"""

from __future__ import annotations

import json
from types import TracebackType
from typing import Any

import aiohttp

from tandem_operator.act.k8s.apply import Request
from tandem_operator.act.k8s.credentials import Credentials

CONNECTIONS = 100  # kubernetes_asyncio's connection_pool_maxsize
TIMEOUT_S = 30.0
USER_AGENT = "tandem-operator"


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

    def __init__(self, credentials: Credentials, *, timeout_s: float = TIMEOUT_S) -> None:
        self.credentials, self.timeout_s = credentials, timeout_s
        self._session: aiohttp.ClientSession | None = None

    async def __aenter__(self) -> RestClient:
        ssl = self.credentials.connection_info().as_ssl_context()
        self._session = aiohttp.ClientSession(
            connector=aiohttp.TCPConnector(limit=CONNECTIONS, ssl=ssl),
            timeout=aiohttp.ClientTimeout(total=self.timeout_s),
            headers={"Accept": "application/json", "User-Agent": USER_AGENT},
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
        ) as response:
            body = await response.read()
            if not 200 <= response.status <= 299:
                raise ApiError(response.status, response.reason or "", _status_message(body))
        return json.loads(body) if body else None
