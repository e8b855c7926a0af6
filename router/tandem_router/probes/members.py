"""The routers of this cluster, as the canary prober splits its rounds between them (thin adapter).

Every router publishes an integrity report under its own 10 s lease (``publisher``), so the reports under
``integrity_prefix(namespace, cluster)`` name the routers alive now: one that stops revokes its lease, one that dies
drops out when the lease expires. The prober hashes each pair over these ids (``integrity.probe_plan``); this
router is always one of them, also before its own report is written or while etcd is away (then the last set
seen stays: each router keeps probing the share it had, and none goes unprobed).

The same reports name the pairs the other routers quarantined (``peer_quarantined``: pair -> the peers' shared
entries for it). A quarantine that rests on a comparison the other router made (a canary, shadow or probation
mismatch: reported with ``publisher.SHARED_PREFIX``) is *shared*: this router adopts it at once
(``IntegrityMonitor.adopt``), as no client can make a comparison look like corruption. One that rests on detector
findings alone (text a client steers) is confirmed here with a canary burst at live concurrency and by comparing
the pair's deterministic answers, and quarantined here only if that fails here too: a client that fools one
router's detectors fools no other.
"""

from __future__ import annotations

import os
import socket
from collections.abc import Mapping, Sequence

from tandem.integrity_watch import IntegrityWatcher
from tandem.registry import EtcdTLS, IntegrityReport
from tandem_router.probes.publisher import SHARED_PREFIX

PairKey = tuple[str, str]


def router_id() -> str:
    """This router's id in the registry: unique per process, stable for its life."""
    return f"{socket.gethostname()}-{os.getpid()}"


class RouterMembers:
    def __init__(
        self, me: str, endpoints: Sequence[str], namespace: str, cluster: str, tls: EtcdTLS | None = None
    ) -> None:
        self.me = me
        self._ids: frozenset[str] = frozenset({me})
        self._peer_quarantined: Mapping[PairKey, frozenset[str]] = {}
        self._watcher = IntegrityWatcher(endpoints, namespace, cluster, self._changed, tls=tls)

    async def _changed(self, reports: dict[str, IntegrityReport]) -> None:
        self._ids = frozenset({r.router for r in reports.values()} | {self.me})
        peers: dict[PairKey, set[str]] = {}
        for r in reports.values():
            if r.router == self.me:
                continue
            for q in r.quarantined:
                entries = peers.setdefault((f"prefill:{q.prefill}", f"decode:{q.decode}"), set())
                if q.reason.startswith(SHARED_PREFIX):
                    entries.add(f"{r.router}: {q.reason.removeprefix(SHARED_PREFIX)}")
        self._peer_quarantined = {pair: frozenset(entries) for pair, entries in peers.items()}

    def ids(self) -> frozenset[str]:
        return self._ids

    def peer_quarantined(self) -> Mapping[PairKey, frozenset[str]]:
        """Pairs (pool keys) other routers of the cluster have in quarantine now, each with the entries ("router:
        reason") of the routers that share it (empty: quarantined on detector findings, confirmed here first)."""
        return self._peer_quarantined

    def start(self) -> None:
        self._watcher.start()

    async def stop(self) -> None:
        await self._watcher.stop()
