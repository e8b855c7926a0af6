"""Workers from the etcd registry: a deleted key drops its worker at once, a removal storm does not.

``EtcdDiscovery`` follows the ``tandem.registry`` keys of one cluster (``tandem.registry_etcd.EndpointWatcher``).
Every removal the registry reports (a delete, a lease expiry, a key missing from a re-listing, a value without the
operator's signature) goes through the ``RegistryGuard`` (``registry_guard``): one removal takes effect at once; a
storm (a frozen registry that comes back and expires its writers' leases, or a registry that comes back empty or
foreign) is held, and the held workers keep serving while the router's own health checks see them alive, until the
registry names them again or settles without them.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import time

from tandem.registry import Endpoint, FabricMode, Role, SessionHistory
from tandem.registry_etcd import EndpointWatcher
from tandem.registry_signing import EndpointVerifier
from tandem_router.config import RouterSettings
from tandem_router.policy.breaker import BreakerState
from tandem_router.pool import WorkerPool, WorkerSpec, WorkerState
from tandem_router.registry_guard import GuardConfig, RegistryGuard

log = logging.getLogger("tandem.router.discovery")

GUARD_TICK_S = 0.5  # how often held workers are checked against the router's health verdicts


def endpoint_spec(endpoint: Endpoint) -> WorkerSpec:
    return WorkerSpec(
        role=endpoint.role,
        url=endpoint.url,
        bootstrap_port=endpoint.bootstrap_port if endpoint.role is Role.PREFILL else None,
        attn_dp_size=endpoint.attn_dp_size,
        model=endpoint.model,
        epoch=endpoint.epoch,
        revision=endpoint.revision,
        fabric_domain=endpoint.fabric_domain,
        fabric_required=endpoint.fabric_mode is FabricMode.REQUIRED,
    )


def guard_config(settings: RouterSettings) -> GuardConfig:
    return GuardConfig(
        panic_share=settings.registry_panic_share,
        min_removals=settings.registry_panic_min_removals,
        window_s=settings.registry_panic_window_s,
        settle_s=settings.registry_settle_s,
    )


def _healthy(state: WorkerState) -> bool:
    return not state.unreachable and state.breaker.state is BreakerState.CLOSED


class EtcdDiscovery:
    """With ``registry_verify_key`` set, an endpoint without the operator's valid signature
    (``tandem.registry_signing``) is never used: it is logged, counted, and handled as if its key were absent (a forged
    value over a real endpoint takes that worker out, it never redirects its traffic)."""

    def __init__(self, pool: WorkerPool, settings: RouterSettings) -> None:
        self.pool = pool
        self._verifier = (
            EndpointVerifier.from_file(settings.registry_verify_key) if settings.registry_verify_key else None
        )
        self.guard = RegistryGuard(guard_config(settings))
        pool.registry_guard = self.guard
        self._keys: dict[str, str] = {}  # registry key -> worker key (held workers included)
        # registry key -> (removed at, the worker as it was): a storm puts back the healthy ones of its window.
        self._gone: dict[str, tuple[float, WorkerState]] = {}
        # every incarnation's Mooncake session ids, kept after a delete: a fence deletes the key before the group's
        # next incarnation is put, and that one must not reuse a dead one's ids.
        self._sessions = SessionHistory()
        self._ticker: asyncio.Task[None] | None = None
        self.watcher = EndpointWatcher(
            settings.etcd.endpoints,
            settings.cluster_namespace,
            settings.cluster_name,
            on_snapshot=self._snapshot,
            on_put=self._put,
            on_delete=self._delete,
            tls=settings.etcd.tls,
        )
        pool.registry_census = self.watcher.census

    async def start(self) -> None:
        self.watcher.start()
        self._ticker = asyncio.create_task(self._tick_loop(), name="registry-guard")
        with contextlib.suppress(asyncio.TimeoutError):
            await asyncio.wait_for(self.watcher.synced.wait(), 5.0)

    async def stop(self) -> None:
        if self._ticker is not None:
            self._ticker.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await self._ticker
        await self.watcher.stop()

    def tick(self, now: float) -> None:
        """Release the held workers the router's checks see failing, or all once the registry has settled."""
        for key in self.guard.tick(now, self.watcher.connected, self._failing):
            worker = self._keys.pop(key, None)
            if worker is not None:
                self.pool.remove(worker)
                log.warning("held worker removed", extra={"key": key, "worker": worker, "held": len(self.guard.held)})
        if not self.guard.panicking and self._gone:
            self._gone = {k: v for k, v in self._gone.items() if now - v[0] < self.guard.config.window_s}

    async def _tick_loop(self) -> None:
        while True:
            await asyncio.sleep(GUARD_TICK_S)
            self.tick(time.monotonic())

    def _failing(self, key: str) -> bool:
        state = self.pool.workers.get(self._keys.get(key, ""))
        return state is None or not _healthy(state)

    def _note_incarnation(self, key: str, endpoint: Endpoint) -> None:
        if reused := self._sessions.note(key, endpoint):
            self.pool.mooncake_session_reuses += 1
            log.warning(
                "recreated group reuses Mooncake session ids of an earlier incarnation: prefills may fail their "
                "first sends to it until the failed-session probe and metadata refresh catch up (operator/README.md)",
                extra={"key": key, "epoch": endpoint.epoch, "sessions": sorted(reused),
                       "held_by_epochs": sorted(set(reused.values()))},
            )  # fmt: skip

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
        trusted = {key: ep for key, ep in endpoints.items() if self._trusted(key, ep)}
        self._removed([key for key in self._keys if key not in trusted])
        for key, endpoint in trusted.items():
            self._register(key, endpoint)
        log.info("registry synced", extra={"workers": sorted(ep.url for ep in trusted.values())})

    def _put(self, key: str, endpoint: Endpoint) -> None:
        if not self._trusted(key, endpoint):
            self._removed([key])
            return
        self._register(key, endpoint)
        log.info("worker registered", extra={"key": key, "worker": endpoint.url, "epoch": endpoint.epoch})

    def _delete(self, key: str) -> None:
        self._removed([key])

    def _register(self, key: str, endpoint: Endpoint) -> None:
        self._note_incarnation(key, endpoint)
        spec = endpoint_spec(endpoint)
        old = self._keys.get(key)
        if old is not None and old != spec.key:
            self.pool.remove(old)
        self._keys[key] = spec.key
        self._gone.pop(key, None)
        self.pool.upsert(spec)
        self.guard.put(key)

    def _removed(self, keys: list[str]) -> None:
        if not keys:
            return
        now = time.monotonic()
        was_panicking = self.guard.panicking
        verdict = self.guard.removed(keys, now, self._healthy_when_gone)
        for key in verdict.remove:
            worker = self._keys.pop(key, None)
            if worker is None:
                continue
            state = self.pool.workers.get(worker)
            if state is not None:
                self._gone[key] = (now, state)
            self.pool.remove(worker)
            log.info("worker deregistered", extra={"key": key, "worker": worker})
        for key in verdict.restore:
            _, state = self._gone.pop(key)
            self._keys[key] = state.spec.key
            self.pool.restore(state)
        if self.guard.panicking and not was_panicking:
            log.warning(
                "registry removal storm: keeping the removed workers while their health checks pass",
                extra={"held": sorted(self.guard.held), "registered": len(self.guard.registered)},
            )

    def _healthy_when_gone(self, key: str) -> bool:
        gone = self._gone.get(key)
        return gone is not None and _healthy(gone[1])
