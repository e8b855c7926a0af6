"""A thin Kubernetes REST adapter over one ``kubernetes_asyncio`` ApiClient: list, get, delete, apply, create.

Errors are the client's ``ApiException``; ``get`` and ``delete`` treat 404 as "already gone". Paths come from
``tandem_operator.k8s.apply`` so requests are built (and tested) without a cluster.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

from kubernetes_asyncio.client.exceptions import ApiException

from tandem_operator.k8s.apply import Request, collection_path, create, send, server_side_apply

JSON = "application/json"
MERGE_PATCH = "application/merge-patch+json"


class Kube:
    def __init__(self, api: Any) -> None:
        self.api = api

    async def _call(
        self, method: str, path: str, query: Mapping[str, str] | None = None, body: Any = None, content: str = JSON
    ) -> Any:
        headers = {"Content-Type": content} if body is not None else {}
        request = Request(method, path, tuple((query or {}).items()), headers, body)
        return await send(self.api, request)

    async def list(self, api_version: str, kind: str, namespace: str, selector: str) -> list[dict[str, Any]]:
        result = await self._call("GET", collection_path(api_version, kind, namespace), {"labelSelector": selector})
        items: list[dict[str, Any]] = result.get("items") or []
        return items

    async def get(self, path: str) -> dict[str, Any] | None:
        try:
            result: dict[str, Any] = await self._call("GET", path)
        except ApiException as err:
            if err.status == 404:
                return None
            raise
        return result

    async def delete(self, path: str, grace_seconds: int | None = None) -> bool:
        """Delete (background propagation); False if it was already gone."""
        body: dict[str, Any] = {"propagationPolicy": "Background"}
        if grace_seconds is not None:
            body["gracePeriodSeconds"] = grace_seconds
        try:
            await self._call("DELETE", path, body=body)
        except ApiException as err:
            if err.status == 404:
                return False
            raise
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
        except ApiException as err:
            if err.status == 404:
                return None
            raise
        return result

    async def apply(self, manifest: dict[str, Any], *, subresource: str | None = None) -> dict[str, Any]:
        return await server_side_apply(self.api, manifest, subresource=subresource)

    async def create(self, manifest: dict[str, Any], *, field_manager: str) -> dict[str, Any]:
        return await create(self.api, manifest, field_manager=field_manager)
