"""Publishes this router's integrity state to etcd, so the operator can surface it on the PDCluster.

One key per router instance (``tandem.registry.integrity_key``) under the router's own lease: a router that dies
stops reporting after ``ttl`` seconds. The report is rewritten when it changes; the lease is kept by a
``tandem.leased_writer.LeasedWriter``, which also puts the last report back under a new lease when etcd lost the old
one (frozen or partitioned for longer than the TTL). A router that stops revokes its lease: the report goes at once.

A *shared* quarantine (one that rests on a comparison this router made, ``QuarantineView.shared``) is reported with
its reason prefixed by ``SHARED_PREFIX``: the cluster's other routers adopt those (``members``). The
report's schema (``tandem.registry.IntegrityReport``) has no field for it, and a reason is free text the operator
shows as it is, so the mark travels in the reason: older readers see a longer reason, nothing else.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import time
from collections.abc import Sequence
from typing import Any

from tandem import registry
from tandem.etcd_errors import EtcdError
from tandem.leased_writer import LeasedWriter
from tandem.registry import EtcdTLS, IntegrityReport, QuarantinedPair, RepeatOffender, Role
from tandem_router.integrity.monitor import IntegrityMonitor

log = logging.getLogger("tandem.router.integrity")

SHARED_PREFIX = "confirmed: "  # a reported reason that starts so: other routers adopt the quarantine


def _url(worker_key: str) -> str:
    return worker_key.split(":", 1)[1]  # pool keys are "<role>:<url>"


def report_of(monitor: IntegrityMonitor, router: str, now: float) -> IntegrityReport:
    return IntegrityReport(
        router=router,
        quarantined=tuple(
            QuarantinedPair(
                prefill=_url(q.prefill),
                decode=_url(q.decode),
                reason=f"{SHARED_PREFIX}{q.reason}" if q.shared else q.reason,
                since_s=round(max(0.0, now - q.since), 1),
            )
            for q in monitor.quarantined()
        ),
        quarantined_workers=tuple(sorted(_url(w) for w in monitor.quarantined_workers())),
        repeat_offenders=tuple(
            RepeatOffender(role=Role(w.split(":", 1)[0]), worker=_url(w), epoch=epoch, quarantines=n, reason=why)
            for w, epoch, n, why in monitor.repeat_offenders()
        ),
    )


def integrity_document(monitor: IntegrityMonitor) -> dict[str, Any]:
    """The router's ``GET /integrity`` document."""
    now = time.monotonic()
    return {
        "enabled": True,
        "quarantined": [
            {
                "prefill": _url(q.prefill),
                "decode": _url(q.decode),
                "since_s": round(now - q.since, 3),
                "reason": q.reason,
                "probation": q.probation,
                "next_probation_in_s": round(max(0.0, q.next_probe_at - now), 3),
                "clean_comparisons": q.clean_comparisons,
                "quarantines": q.quarantines,
            }
            for q in monitor.quarantined()
        ],
        "quarantined_workers": sorted(_url(w) for w in monitor.quarantined_workers()),
        "quarantined_share": round(monitor.quarantined_share(), 4),
        "repeat_offenders": [
            {"worker": _url(w), "epoch": epoch, "quarantines": n, "reason": why}
            for w, epoch, n, why in monitor.repeat_offenders()
        ],
    }


class IntegrityPublisher:
    def __init__(
        self,
        monitor: IntegrityMonitor,
        etcd_endpoints: Sequence[str],
        namespace: str,
        cluster: str,
        router: str,
        ttl: int = 10,
        interval_s: float = 1.0,
        tls: EtcdTLS | None = None,
    ) -> None:
        self.monitor = monitor
        self.endpoints, self.tls = list(etcd_endpoints), tls
        self.router = router
        self.key = registry.integrity_key(namespace, cluster, self.router).encode()
        self.ttl, self.interval_s = ttl, interval_s

    async def run(self, stop: asyncio.Event) -> None:
        writer = LeasedWriter(self.endpoints, self.ttl, tls=self.tls)
        written: tuple[object, ...] | None = None
        started = False
        try:
            while not stop.is_set():
                try:
                    if not started:  # etcd may not answer yet when the router starts: tried again each interval
                        await writer.start()
                        started = True
                    report = report_of(self.monitor, self.router, time.monotonic())
                    # "since_s" changes every second; rewrite only when the set of pairs or reasons changed.
                    identity = (
                        tuple((q.prefill, q.decode, q.reason) for q in report.quarantined),
                        tuple((o.worker, o.epoch) for o in report.repeat_offenders),
                    )
                    if identity != written:
                        await writer.put(self.key, report.model_dump_json().encode())
                        written = identity
                except EtcdError as err:  # etcd away: the next interval writes again
                    log.warning("integrity report not published", extra={"error": repr(err)})
                with contextlib.suppress(TimeoutError):
                    await asyncio.wait_for(stop.wait(), self.interval_s)
        finally:
            await writer.close(revoke=True)
