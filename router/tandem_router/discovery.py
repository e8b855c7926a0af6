"""Where workers come from: static flags, the etcd registry (``discovery_etcd``), or Kubernetes pods. Each source
keeps the pool's membership equal to what it sees; the pure conversions (registry value / pod -> WorkerSpec) are
separate so they are tested without etcd or a cluster."""

from __future__ import annotations

import asyncio
import contextlib
import functools
import os
from collections.abc import Mapping, Sequence
from typing import Any, Protocol

from tandem.kube import credentials
from tandem.kube.rest import RestClient
from tandem.kube.watch import list_then_watch
from tandem.registry import Role
from tandem_router.config import RouterSettings
from tandem_router.pool import WorkerPool, WorkerSpec

BOOTSTRAP_PORT_ANNOTATION = "sglang.ai/bootstrap-port"
REVISION_LABEL = "tandem.dev/revision"  # the operator's compatibility revision on every worker pod
DEFAULT_BOOTSTRAP_PORT = 8998


class Discovery(Protocol):
    async def start(self) -> None: ...

    async def stop(self) -> None: ...


def static_specs(settings: RouterSettings) -> list[WorkerSpec]:
    prefills = [WorkerSpec(Role.PREFILL, p.url, p.bootstrap_port, p.attn_dp_size) for p in settings.prefill]
    return prefills + [WorkerSpec(Role.DECODE, url) for url in settings.decode]


def pod_spec(pod: Mapping[str, Any], role: Role, port: int) -> WorkerSpec | None:
    """A Kubernetes pod (API JSON) as a worker, or None while it must not get traffic: not Ready, no IP yet, or
    being deleted. The prefill's bootstrap port comes from the ``sglang.ai/bootstrap-port`` annotation."""
    meta = pod.get("metadata") or {}
    status = pod.get("status") or {}
    if meta.get("deletionTimestamp") or status.get("phase") != "Running":
        return None
    ip = status.get("podIP")
    ready = any(c.get("type") == "Ready" and c.get("status") == "True" for c in status.get("conditions") or ())
    if not ip or not ready:
        return None
    bootstrap_port: int | None = None
    if role is Role.PREFILL:
        raw = (meta.get("annotations") or {}).get(BOOTSTRAP_PORT_ANNOTATION)
        bootstrap_port = int(raw) if isinstance(raw, str) and raw.isdigit() else DEFAULT_BOOTSTRAP_PORT
    host = f"[{ip}]" if ":" in ip else ip
    revision = str((meta.get("labels") or {}).get(REVISION_LABEL, ""))
    return WorkerSpec(role, f"http://{host}:{port}", bootstrap_port, revision=revision)


class StaticDiscovery:
    def __init__(self, pool: WorkerPool, settings: RouterSettings) -> None:
        self.pool, self.settings = pool, settings

    async def start(self) -> None:
        self.pool.replace_all(static_specs(self.settings))

    async def stop(self) -> None:
        return None


class KubernetesDiscovery:
    """Lists, then watches, the pods matching the prefill and decode label selectors (``tandem.kube.watch``, the
    client the operator uses too).

    Every (re)connection starts with a listing that replaces the role's workers (``resync``), then watches from
    the listing's resourceVersion. A watch that fails -- a dropped connection, an API server restart, a ``410
    Gone`` for an expired resourceVersion -- is followed by a new listing, so pods deleted during the gap leave
    the pool: no DELETED event will ever come for them (client-go's reflector does the same). A watch the server
    ends (after ``watch_timeout_s``) is no gap: the next starts from the last version seen. Credentials: the
    ``kubeconfig`` given, else ``KUBECONFIG``, else the pod's ServiceAccount, else ``~/.kube/config`` (as the
    operator's ``--kubeconfig``).
    """

    def __init__(
        self,
        pool: WorkerPool,
        settings: RouterSettings,
        kubeconfig: str | None = None,
        retry_s: float = 1.0,
        watch_timeout_s: int = 300,
    ) -> None:
        self.pool, self.settings = pool, settings
        self.kubeconfig, self.retry_s, self.watch_timeout_s = kubeconfig, retry_s, watch_timeout_s
        self.listings = 0  # (re-)listings done: one per role at start, one more after every watch gap
        self._tasks: list[asyncio.Task[None]] = []
        self._seen: dict[Role, dict[str, str]] = {Role.PREFILL: {}, Role.DECODE: {}}
        self._client = contextlib.AsyncExitStack()

    async def start(self) -> None:
        login = credentials.load(self.kubeconfig or os.environ.get("KUBECONFIG"))
        rest = await self._client.enter_async_context(RestClient(login, user_agent="tandem-router"))
        path = f"/api/v1/namespaces/{self.settings.k8s_namespace}/pods"
        for role, selector in (
            (Role.PREFILL, self.settings.k8s_prefill_selector),
            (Role.DECODE, self.settings.k8s_decode_selector),
        ):
            watching = list_then_watch(
                rest,
                path,
                selector,
                resync=functools.partial(self._relisted, role),
                apply=functools.partial(self.apply, role),
                watch_timeout_s=self.watch_timeout_s,
                retry_s=self.retry_s,
            )
            self._tasks.append(asyncio.create_task(watching))

    async def stop(self) -> None:
        for task in self._tasks:
            task.cancel()
        await asyncio.gather(*self._tasks, return_exceptions=True)
        await self._client.aclose()

    def apply(self, role: Role, event_type: str, pod: Mapping[str, Any]) -> None:
        """One watch event: ADDED/MODIFIED upserts or (not ready) removes; DELETED removes."""
        name = str((pod.get("metadata") or {}).get("name", ""))
        spec = None if event_type == "DELETED" else pod_spec(pod, role, self.settings.k8s_worker_port)
        old = self._seen[role].pop(name, None)
        if old is not None and (spec is None or old != spec.key):
            self.pool.remove(old)
        if spec is not None:
            self._seen[role][name] = spec.key
            self.pool.upsert(spec)

    def resync(self, role: Role, pods: Sequence[Mapping[str, Any]]) -> None:
        """A (re-)listing: the role's workers become exactly the listed pods that may get traffic."""
        listed = {str((pod.get("metadata") or {}).get("name", "")): pod for pod in pods}
        for gone in self._seen[role].keys() - listed.keys():
            self.apply(role, "DELETED", {"metadata": {"name": gone}})
        for pod in listed.values():
            self.apply(role, "MODIFIED", pod)

    def _relisted(self, role: Role, pods: Sequence[Mapping[str, Any]]) -> None:
        self.resync(role, pods)
        self.listings += 1


def make_discovery(pool: WorkerPool, settings: RouterSettings) -> Discovery:
    from tandem_router.config import DiscoveryMode

    if settings.discovery is DiscoveryMode.ETCD:
        from tandem_router.discovery_etcd import EtcdDiscovery

        return EtcdDiscovery(pool, settings)
    if settings.discovery is DiscoveryMode.KUBERNETES:
        return KubernetesDiscovery(pool, settings)
    return StaticDiscovery(pool, settings)
