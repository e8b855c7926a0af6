"""Watches one PD cluster's integrity reports in etcd (thin adapter): the operator shows them on the
PDCluster (``tandem_operator.decide.integrity``); the routers split the canary probing among the routers that report
(``tandem_router.probes.members``).

Lists ``integrity_prefix(namespace, cluster)``, then watches it from the next revision; a PUT upserts a report, a
DELETE -- a router removed it, or its lease expired -- drops it. Every change calls ``on_change`` with the whole
current set (etcd key -> report). After a lost connection it re-lists, so the set converges to etcd's content.
A malformed report is logged and left out.
"""

from __future__ import annotations

import logging
from collections.abc import Awaitable, Callable, Sequence

import pydantic

from tandem import registry
from tandem.registry import EtcdTLS, IntegrityReport
from tandem.registry_etcd import PrefixWatcher

log = logging.getLogger("tandem.integrity.watch")

OnChange = Callable[[dict[str, IntegrityReport]], Awaitable[None]]


class IntegrityWatcher(PrefixWatcher[IntegrityReport]):
    def __init__(
        self,
        endpoints: Sequence[str],
        namespace: str,
        cluster: str,
        on_change: OnChange,
        retry_s: float = 1.0,
        tls: EtcdTLS | None = None,
    ) -> None:
        super().__init__(endpoints, registry.integrity_prefix(namespace, cluster), _parse, on_change, retry_s, tls)


def _parse(key: bytes, value: bytes) -> IntegrityReport | None:
    try:
        return IntegrityReport.model_validate_json(value)
    except pydantic.ValidationError as err:
        log.error("malformed integrity report skipped", extra={"key": key.decode(errors="replace"), "error": str(err)})
        return None
