"""The routers of this cluster, as the canary prober splits its rounds between them (thin adapter).

Every router publishes an integrity report under its own 10 s lease (``integrity_publisher``), so the reports under
``integrity_prefix(namespace, cluster)`` name the routers alive now: one that stops revokes its lease, one that dies
drops out when the lease expires. The prober hashes each pair over these ids (``integrity.probe_plan``); this
router is always one of them, also before its own report is written or while etcd is away (then the last set
seen stays: each router keeps probing the share it had, and none goes unprobed).

The same reports name the pairs the other routers quarantined (``peer_quarantined``): each router judges only
what it saw itself (a leak is found only by the router that also carried the leaked prompt), so a pair another
router took out is confirmed here with a canary burst at live concurrency, and quarantined here only if that burst
fails here too. A router never quarantines on another's word, so a client that fools one router fools no other.
"""

from __future__ import annotations

import os
import socket
from collections.abc import Sequence

from tandem.integrity_watch import IntegrityWatcher
from tandem.registry import EtcdTLS, IntegrityReport


def router_id() -> str:
    """This router's id in the registry: unique per process, stable for its life."""
    return f"{socket.gethostname()}-{os.getpid()}"


class RouterMembers:
    def __init__(
        self, me: str, endpoints: Sequence[str], namespace: str, cluster: str, tls: EtcdTLS | None = None
    ) -> None:
        self.me = me
        self._ids: frozenset[str] = frozenset({me})
        self._peer_quarantined: frozenset[tuple[str, str]] = frozenset()
        self._watcher = IntegrityWatcher(endpoints, namespace, cluster, self._changed, tls=tls)

    async def _changed(self, reports: dict[str, IntegrityReport]) -> None:
        self._ids = frozenset({r.router for r in reports.values()} | {self.me})
        self._peer_quarantined = frozenset(
            (f"prefill:{q.prefill}", f"decode:{q.decode}")
            for r in reports.values()
            if r.router != self.me
            for q in r.quarantined
        )

    def ids(self) -> frozenset[str]:
        return self._ids

    def peer_quarantined(self) -> frozenset[tuple[str, str]]:
        """Pairs (pool keys) other routers of the cluster have in quarantine now."""
        return self._peer_quarantined

    def start(self) -> None:
        self._watcher.start()

    async def stop(self) -> None:
        await self._watcher.stop()
