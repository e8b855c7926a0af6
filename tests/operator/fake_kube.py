"""An in-memory stand-in for the API server, used only until the real test control plane (issue 4) lands on this
branch: it stores objects by REST path and implements the few verbs the operator's ``Kube`` adapter uses
(list by equality label selector, get, server-side apply as a whole-object upsert, create, delete). It does not
validate, schedule, run pods or garbage-collect: tests move pods through their lifecycle themselves.
"""

from __future__ import annotations

import copy
import itertools
from typing import Any

from kubernetes_asyncio.client.exceptions import ApiException

from tandem_operator.k8s.apply import collection_path, object_path
from tandem_operator.k8s.kube import Kube


class FakeKube(Kube):
    def __init__(self) -> None:
        super().__init__(api=None)
        self.objects: dict[str, dict[str, Any]] = {}
        self.events: list[dict[str, Any]] = []
        self.deleted: list[str] = []
        self._uids = itertools.count(1)

    async def list(self, api_version: str, kind: str, namespace: str, selector: str) -> list[dict[str, Any]]:
        prefix = collection_path(api_version, kind, namespace) + "/"
        wanted = dict(part.split("=", 1) for part in selector.split(",") if part)
        return [
            copy.deepcopy(obj)
            for path, obj in sorted(self.objects.items())
            if path.startswith(prefix)
            and "/" not in path[len(prefix) :]
            and all(obj["metadata"].get("labels", {}).get(k) == v for k, v in wanted.items())
        ]

    async def get(self, path: str) -> dict[str, Any] | None:
        found = self.objects.get(path)
        return copy.deepcopy(found) if found is not None else None

    async def delete(self, path: str, grace_seconds: int | None = None) -> bool:
        self.deleted.append(path)
        return self.objects.pop(path, None) is not None

    async def post(self, path: str, body: dict[str, Any]) -> dict[str, Any]:
        self.events.append(body)
        return body

    async def put(self, path: str, body: dict[str, Any]) -> dict[str, Any]:
        raise ApiException(status=405, reason="not supported by FakeKube")

    async def apply(self, manifest: dict[str, Any], *, subresource: str | None = None) -> dict[str, Any]:
        path = object_path(manifest)
        if subresource == "status":
            self.objects[path]["status"] = copy.deepcopy(manifest["status"])
            return copy.deepcopy(self.objects[path])
        stored = self.objects.get(path)
        body = copy.deepcopy(manifest)
        body["metadata"].setdefault("uid", stored["metadata"]["uid"] if stored else f"uid-{next(self._uids)}")
        if stored is not None:
            body.setdefault("status", stored.get("status", {}))
            if "spec" in stored and "replicas" in stored["spec"]:
                body["spec"].setdefault("replicas", stored["spec"]["replicas"])
        self.objects[path] = body
        return copy.deepcopy(body)

    async def create(self, manifest: dict[str, Any], *, field_manager: str) -> dict[str, Any]:
        path = object_path(manifest)
        if path in self.objects:
            raise ApiException(status=409, reason="AlreadyExists")
        return await self.apply(manifest)

    # -- what kubelets / kwok do in a real cluster --------------------------------------------------------------
    def pods(self, namespace: str = "serving") -> dict[str, dict[str, Any]]:
        prefix = f"/api/v1/namespaces/{namespace}/pods/"
        return {path[len(prefix) :]: obj for path, obj in self.objects.items() if path.startswith(prefix)}

    def run_pod(self, name: str, ip: str, namespace: str = "serving") -> dict[str, Any]:
        pod = self.objects[f"/api/v1/namespaces/{namespace}/pods/{name}"]
        pod["spec"]["nodeName"] = f"node-{name}"
        pod["status"] = {"phase": "Running", "podIP": ip, "conditions": [{"type": "Ready", "status": "True"}]}
        return copy.deepcopy(pod)
