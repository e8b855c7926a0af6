"""A thin Kubernetes REST adapter over the shared ``tandem.kube.rest.RestClient``: list, get, delete, apply, create.

API errors are mapped to the adapter's own exceptions, so callers never see the client library's:
``NotFoundError`` (404; ``get``, ``delete`` and ``merge_patch`` treat it as "already gone"), ``ConflictError`` (409),
``TemporaryError`` (429, 5xx, a lost connection or a timeout: retried ``RETRIES`` times with exponential backoff
before it is raised) and ``PermanentError`` (any other status: a bad request is not retried). Paths come from
``tandem_operator.act.k8s.apply`` so requests are built (and tested) without a cluster.
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Callable, Mapping
from typing import Any, Protocol

import aiohttp

from tandem.kube.rest import ApiError, Request
from tandem_operator.act.k8s.apply import apply_request, collection_path, create_request

JSON = "application/json"
MERGE_PATCH = "application/merge-patch+json"
RETRIES = 4
BACKOFF_S = 0.2  # doubled after each try: 0.2, 0.4, 0.8 s
TEMPORARY_STATUSES = frozenset({429, 500, 502, 503, 504})
LIST_PAGE = 50  # objects per list page: a page is parsed and trimmed before the next one is read (the peak)

log = logging.getLogger("tandem.operator.kube")


class Sender(Protocol):
    """What sends a request (``tandem.kube.rest.RestClient``): raises ``ApiError``, ``aiohttp.ClientError`` or
    ``TimeoutError``."""

    async def send(self, request: Request) -> Any: ...


class KubeError(Exception):
    def __init__(self, status: int, reason: str, request: str, message: str = "") -> None:
        super().__init__(f"{request}: {status} {reason}" + (f": {message}" if message else ""))
        self.status, self.reason = status, reason


class NotFoundError(KubeError):
    pass


class ConflictError(KubeError):
    pass


class TemporaryError(KubeError):
    pass


class PermanentError(KubeError):
    pass


def api_error(err: ApiError | aiohttp.ClientError | TimeoutError, request: str) -> KubeError:
    """The adapter's exception for a client error (a lost connection is status 0, temporary)."""
    if not isinstance(err, ApiError):
        return TemporaryError(0, repr(err), request)
    status, reason, message = err.status, err.reason, err.message
    if status == 404:
        return NotFoundError(status, reason, request, message)
    if status == 409:
        return ConflictError(status, reason, request, message)
    if status in TEMPORARY_STATUSES or status == 0:
        return TemporaryError(status, reason, request, message)
    return PermanentError(status, reason, request, message)


class Kube:
    def __init__(
        self, api: Sender, *, backoff_s: float = BACKOFF_S, on_request: Callable[[str], None] | None = None
    ) -> None:
        """``on_request(method)`` is called for every request sent, retries included (the operator's metrics)."""
        self.api, self.backoff_s, self.on_request = api, backoff_s, on_request

    async def send(self, request: Request) -> Any:
        """Send, retrying temporary errors with exponential backoff; raises a ``KubeError``."""
        delay = self.backoff_s
        for attempt in range(1, RETRIES + 1):
            if self.on_request is not None:
                self.on_request(request.method)
            try:
                return await self.api.send(request)
            except (ApiError, aiohttp.ClientError, TimeoutError) as err:
                error = api_error(err, f"{request.method} {request.path}")
            if not isinstance(error, TemporaryError) or attempt == RETRIES:
                raise error
            log.info("kube request retried", extra={"request": str(error), "attempt": attempt})
            await asyncio.sleep(delay)
            delay *= 2
        raise AssertionError("unreachable")

    async def _call(
        self, method: str, path: str, query: Mapping[str, str] | None = None, body: Any = None, content: str = JSON
    ) -> Any:
        headers = {"Content-Type": content} if body is not None else {}
        return await self.send(Request(method, path, tuple((query or {}).items()), headers, body))

    async def list(
        self,
        api_version: str,
        kind: str,
        namespace: str,
        selector: str,
        keep: Callable[[dict[str, Any]], dict[str, Any]] | None = None,
    ) -> list[dict[str, Any]]:
        """Every matching object, read ``LIST_PAGE`` at a time; ``keep`` trims each object as its page arrives,
        so at most one page of whole objects is in memory."""
        path, items = collection_path(api_version, kind, namespace), []
        query = {"labelSelector": selector, "limit": str(LIST_PAGE)}
        while True:
            result = await self._call("GET", path, query)
            page: list[dict[str, Any]] = result.get("items") or []
            items += [keep(item) for item in page] if keep is not None else page
            token = (result.get("metadata") or {}).get("continue")
            if not token:
                return items
            query["continue"] = token

    async def get(self, path: str) -> dict[str, Any] | None:
        try:
            result: dict[str, Any] = await self._call("GET", path)
        except NotFoundError:
            return None
        return result

    async def delete(self, path: str, grace_seconds: int | None = None) -> bool:
        """Delete (background propagation); False if it was already gone."""
        body: dict[str, Any] = {"propagationPolicy": "Background"}
        if grace_seconds is not None:
            body["gracePeriodSeconds"] = grace_seconds
        try:
            await self._call("DELETE", path, body=body)
        except NotFoundError:
            return False
        return True

    async def put(self, path: str, body: dict[str, Any]) -> dict[str, Any]:
        result: dict[str, Any] = await self._call("PUT", path, body=body)
        return result

    async def post(self, path: str, body: dict[str, Any]) -> dict[str, Any]:
        result: dict[str, Any] = await self._call("POST", path, body=body)
        return result

    async def merge_patch(self, path: str, body: dict[str, Any]) -> dict[str, Any] | None:
        """A JSON merge patch (its fields belong to no apply manager, so later applies keep them); None on 404."""
        try:
            result: dict[str, Any] = await self._call("PATCH", path, body=body, content=MERGE_PATCH)
        except NotFoundError:
            return None
        return result

    async def apply(self, manifest: dict[str, Any], *, subresource: str | None = None) -> dict[str, Any]:
        result: dict[str, Any] = await self.send(apply_request(manifest, subresource=subresource))
        return result

    async def create(self, manifest: dict[str, Any], *, field_manager: str) -> dict[str, Any]:
        result: dict[str, Any] = await self.send(create_request(manifest, field_manager=field_manager))
        return result
