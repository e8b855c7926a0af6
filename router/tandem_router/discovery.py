"""Where workers come from: static flags, the etcd registry, or Kubernetes pods. Each source keeps the pool's
membership equal to what it sees; the pure conversions (registry value / pod -> WorkerSpec) are separate so
they are tested without etcd or a cluster."""

from __future__ import annotations

import asyncio
import contextlib
import logging
from collections.abc import Mapping
from typing import Any, Protocol

from tandem.registry import Endpoint, Role, reused_sessions
from tandem_router.config import RouterSettings
from tandem_router.pool import WorkerPool, WorkerSpec

log = logging.getLogger("tandem.router.discovery")

BOOTSTRAP_PORT_ANNOTATION = "sglang.ai/bootstrap-port"
REVISION_LABEL = "tandem.dev/revision"  # the operator's compatibility revision on every worker pod
DEFAULT_BOOTSTRAP_PORT = 8998


class Discovery(Protocol):
    async def start(self) -> None: ...

    async def stop(self) -> None: ...


def static_specs(settings: RouterSettings) -> list[WorkerSpec]:
    prefills = [WorkerSpec(Role.PREFILL, p.url, p.bootstrap_port, p.attn_dp_size) for p in settings.prefill]
    return prefills + [WorkerSpec(Role.DECODE, url) for url in settings.decode]


def endpoint_spec(endpoint: Endpoint) -> WorkerSpec:
    return WorkerSpec(
        role=endpoint.role,
        url=endpoint.url,
        bootstrap_port=endpoint.bootstrap_port if endpoint.role is Role.PREFILL else None,
        attn_dp_size=endpoint.attn_dp_size,
        model=endpoint.model,
        epoch=endpoint.epoch,
        revision=endpoint.revision,
    )


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


class EtcdDiscovery:
    """Follows ``tandem.registry`` keys of one cluster; a deleted key drops its worker at once.

    With ``registry_verify_key`` set, an endpoint without the operator's valid signature (``tandem.registry_signing``)
    is never used: it is logged, counted, and handled as if its key were absent (a forged value over a real
    endpoint takes that worker out, it never redirects its traffic)."""

    def __init__(self, pool: WorkerPool, settings: RouterSettings) -> None:
        from tandem.registry_etcd import EndpointWatcher
        from tandem.registry_signing import EndpointVerifier

        self.pool = pool
        self._verifier = (
            EndpointVerifier.from_file(settings.registry_verify_key) if settings.registry_verify_key else None
        )
        self._keys: dict[str, str] = {}  # registry key -> worker key
        # registry key -> latest incarnation seen, kept after a delete: a fence deletes the key before the group's
        # next incarnation is put, and that one must not reuse the dead one's Mooncake session ids.
        self._incarnations: dict[str, Endpoint] = {}
        self.watcher = EndpointWatcher(
            settings.etcd_endpoints,
            settings.cluster_namespace,
            settings.cluster_name,
            on_snapshot=self._snapshot,
            on_put=self._put,
            on_delete=self._delete,
            tls=settings.etcd_tls,
        )

    async def start(self) -> None:
        self.watcher.start()
        with contextlib.suppress(asyncio.TimeoutError):
            await asyncio.wait_for(self.watcher.synced.wait(), 5.0)

    async def stop(self) -> None:
        await self.watcher.stop()

    def _note_incarnation(self, key: str, endpoint: Endpoint) -> None:
        earlier = self._incarnations.get(key)
        if earlier is not None and (reused := reused_sessions(earlier, endpoint)):
            self.pool.mooncake_session_reuses += 1
            log.warning(
                "recreated group reuses Mooncake session ids of its previous incarnation: prefills may fail their "
                "first sends to it until the failed-session probe and metadata refresh catch up (operator/README.md)",
                extra={"key": key, "epoch": endpoint.epoch, "sessions": sorted(reused)},
            )
        if earlier is None or endpoint.epoch >= earlier.epoch:
            self._incarnations[key] = endpoint

    def _trusted(self, key: str, endpoint: Endpoint) -> bool:
        if self._verifier is None or self._verifier.verify(key, endpoint):
            return True
        self.pool.forged_endpoints += 1
        log.error(
            "registry endpoint without a valid operator signature ignored: someone other than the operator wrote it",
            extra={"key": key, "worker": endpoint.url, "signed": bool(endpoint.signature)},
        )
        return False

    def _snapshot(self, endpoints: dict[str, Endpoint]) -> None:
        endpoints = {key: ep for key, ep in endpoints.items() if self._trusted(key, ep)}
        for key, endpoint in endpoints.items():
            self._note_incarnation(key, endpoint)
        specs = {key: endpoint_spec(ep) for key, ep in endpoints.items()}
        self._keys = {key: spec.key for key, spec in specs.items()}
        self.pool.replace_all(specs.values())
        log.info("registry synced", extra={"workers": sorted(s.url for s in specs.values())})

    def _put(self, key: str, endpoint: Endpoint) -> None:
        if not self._trusted(key, endpoint):
            self._delete(key)
            return
        self._note_incarnation(key, endpoint)
        spec = endpoint_spec(endpoint)
        old = self._keys.get(key)
        if old is not None and old != spec.key:
            self.pool.remove(old)
        self._keys[key] = spec.key
        self.pool.upsert(spec)
        log.info("worker registered", extra={"key": key, "worker": spec.url, "epoch": spec.epoch})

    def _delete(self, key: str) -> None:
        worker = self._keys.pop(key, None)
        if worker is not None:
            self.pool.remove(worker)
            log.info("worker deregistered", extra={"key": key, "worker": worker})


class KubernetesDiscovery:
    """Lists, then watches, the pods matching the prefill and decode label selectors (kubernetes_asyncio).

    Every (re)connection starts with a listing that replaces the role's workers (``resync``), then watches from
    the listing's resourceVersion. A watch that ends or fails -- a dropped connection, an API server restart, a
    ``410 Gone`` for an expired resourceVersion -- is followed by a new listing, so pods deleted during the gap
    leave the pool: no DELETED event will ever come for them (client-go's reflector does the same).
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
        self._config: Any = None

    async def start(self) -> None:
        from kubernetes_asyncio import client
        from kubernetes_asyncio import config as k8s_config

        self._config = client.Configuration()
        if self.kubeconfig is not None:
            await k8s_config.load_kube_config(config_file=self.kubeconfig, client_configuration=self._config)
        else:
            try:
                k8s_config.load_incluster_config(client_configuration=self._config)  # type: ignore[no-untyped-call]
            except k8s_config.ConfigException:
                await k8s_config.load_kube_config(client_configuration=self._config)
        for role, selector in (
            (Role.PREFILL, self.settings.k8s_prefill_selector),
            (Role.DECODE, self.settings.k8s_decode_selector),
        ):
            self._tasks.append(asyncio.create_task(self._watch(role, selector)))

    async def stop(self) -> None:
        for task in self._tasks:
            task.cancel()
        await asyncio.gather(*self._tasks, return_exceptions=True)

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

    def resync(self, role: Role, pods: list[Mapping[str, Any]]) -> None:
        """A (re-)listing: the role's workers become exactly the listed pods that may get traffic."""
        listed = {str((pod.get("metadata") or {}).get("name", "")): pod for pod in pods}
        for gone in self._seen[role].keys() - listed.keys():
            self.apply(role, "DELETED", {"metadata": {"name": gone}})
        for pod in listed.values():
            self.apply(role, "MODIFIED", pod)

    async def _watch(self, role: Role, selector: str) -> None:
        from kubernetes_asyncio import client, watch

        namespace = self.settings.k8s_namespace
        async with client.ApiClient(configuration=self._config) as api:
            core = client.CoreV1Api(api)
            while True:
                try:
                    listing = await core.list_namespaced_pod(namespace, label_selector=selector, _request_timeout=30)
                    self.resync(role, [api.sanitize_for_serialization(pod) for pod in listing.items])
                    self.listings += 1
                    async with watch.Watch() as pods:
                        stream = pods.stream(
                            core.list_namespaced_pod,
                            namespace,
                            label_selector=selector,
                            resource_version=listing.metadata.resource_version,
                            timeout_seconds=self.watch_timeout_s,
                            _request_timeout=self.watch_timeout_s + 30,
                        )
                        async for event in stream:
                            self.apply(role, event["type"], api.sanitize_for_serialization(event["object"]))
                    continue  # the server ended the watch (its timeout): list again at once
                except asyncio.CancelledError:
                    raise
                except Exception as err:
                    log.warning("pod watch failed; re-listing", extra={"role": role.value, "error": repr(err)})
                await asyncio.sleep(self.retry_s)


def make_discovery(pool: WorkerPool, settings: RouterSettings) -> Discovery:
    from tandem_router.config import DiscoveryMode

    if settings.discovery is DiscoveryMode.ETCD:
        return EtcdDiscovery(pool, settings)
    if settings.discovery is DiscoveryMode.KUBERNETES:
        return KubernetesDiscovery(pool, settings)
    return StaticDiscovery(pool, settings)
