"""In-memory stand-ins for the executor's adapters: a Kube that records every call and a Registrar without etcd."""

from __future__ import annotations

import builtins
from collections.abc import Callable
from typing import Any

from tandem.kube.rest import Request
from tandem.registry import Endpoint, Role
from tandem_operator.act.k8s.apply import object_path
from tandem_operator.act.k8s.kube import Kube
from tandem_operator.act.registrar import Registrar
from tandem_operator.api.pdcluster import PDClusterSpec
from tandem_operator.decide.fencing import StaleKeys
from tandem_operator.decide.observe import GroupKey
from tandem_operator.desired.naming import ClusterRef
from tandem_operator.desired.pools import pool_manifest

Trim = Callable[[dict[str, Any]], dict[str, Any]]  # Kube.list's ``keep``


class NoServer:
    """The client of a Kube stand-in that overrides the verbs a test uses: a request that still gets sent is a bug."""

    async def send(self, request: Request) -> Any:
        raise AssertionError(f"FakeKube sent {request.method} {request.path}")


def with_pools(kube: FakeKube, ref: ClusterRef, spec: PDClusterSpec) -> None:
    """The cluster's PDPools exist (with uids), as after the operator's first pass: a pass goes on to the groups."""
    for role in Role:
        pool = pool_manifest(ref, spec, role, create=True)
        pool["metadata"]["uid"] = f"uid-{role.value}"
        kube.objects[object_path(pool)] = pool


class FakeKube(Kube):
    """Records calls as ``(verb, path or name, detail)``; ``objects`` answers ``get`` and ``list``."""

    def __init__(self) -> None:
        super().__init__(api=NoServer())
        self.calls: builtins.list[tuple[str, str, Any]] = []
        self.objects: dict[str, dict[str, Any]] = {}

    async def apply(self, manifest: dict[str, Any], *, subresource: str | None = None) -> dict[str, Any]:
        self.calls.append(("apply", manifest["metadata"]["name"], manifest))
        return manifest

    async def create(self, manifest: dict[str, Any], *, field_manager: str) -> dict[str, Any]:
        self.calls.append(("create", manifest["metadata"]["name"], manifest))
        return manifest

    async def delete(self, path: str, grace_seconds: int | None = None) -> bool:
        self.calls.append(("delete", path, grace_seconds))
        return True

    async def get(self, path: str) -> dict[str, Any] | None:
        return self.objects.get(path)

    async def list(
        self, api_version: str, kind: str, namespace: str, selector: str, keep: Trim | None = None
    ) -> builtins.list[dict[str, Any]]:
        found = [o for o in self.objects.values() if (o["apiVersion"], o["kind"]) == (api_version, kind)]
        return [keep(o) for o in found] if keep is not None else found

    async def post(self, path: str, body: dict[str, Any]) -> dict[str, Any]:
        self.calls.append(("post", path, body))
        return body

    async def merge_patch(self, path: str, body: dict[str, Any]) -> dict[str, Any] | None:
        self.calls.append(("patch", path, body))
        return body

    def verbs(self, *verbs: str) -> builtins.list[tuple[str, str, Any]]:
        return [c for c in self.calls if c[0] in verbs]


class FakeRegistrar(Registrar):
    """Registry writes in memory, logged in order (``log`` shares nothing with a real etcd)."""

    def __init__(self, log: list[tuple[str, str, Any]] | None = None) -> None:
        super().__init__(["http://127.0.0.1:1"])
        self.entries: dict[str, Endpoint] = {}
        self.log = log if log is not None else []

    async def put(self, namespace: str, cluster: str, endpoint: Endpoint) -> str:
        self.entries[endpoint.group] = endpoint
        self.log.append(("put", endpoint.group, endpoint.epoch))
        return endpoint.group

    async def fence(self, namespace: str, cluster: str, group: GroupKey) -> bool:
        self.log.append(("unregister", group.name, None))
        return self.entries.pop(group.name, None) is not None

    async def delete_stale(self, stale: StaleKeys) -> int:
        return len(stale.keys) + len(stale.prefixes)
