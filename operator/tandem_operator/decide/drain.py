"""When a retiring group may be deleted: after its in-flight work reached 0, or the drain timeout. Pure.

Scale-down and rollouts first delete the group's registry entry (routers watching etcd drop it within
milliseconds), then wait for the group's leader to report nothing in flight (``desired.drain_hook.DRAIN_GAUGES``)
and only then delete its pods. ``SETTLE_S`` covers requests a router had already sent before it saw the delete.
"""

from __future__ import annotations

from enum import StrEnum

from prometheus_client.parser import text_string_to_metric_families

from tandem_operator.desired.drain_hook import DRAIN_GAUGES

SETTLE_S = 2.0
POLL_S = 1.0  # how often the reconcile re-checks a draining group


class DrainVerdict(StrEnum):
    WAIT = "Wait"
    DRAINED = "Drained"
    TIMED_OUT = "TimedOut"


def in_flight(metrics_text: str) -> int | None:
    """The sum of the drain gauges in a Prometheus exposition; None when it has none of them."""
    names = set(DRAIN_GAUGES)
    found = False
    total = 0.0
    for family in text_string_to_metric_families(metrics_text):
        if family.name in names:
            found = True
            total += sum(sample.value for sample in family.samples)
    return round(total) if found else None


def drain_verdict(elapsed_s: float, in_flight_now: int | None, timeout_s: float) -> DrainVerdict:
    """``in_flight_now``: the leader's in-flight count, 0 when nothing listens, None when it could not be read."""
    if elapsed_s < SETTLE_S:
        return DrainVerdict.WAIT
    if in_flight_now == 0:
        return DrainVerdict.DRAINED
    if elapsed_s >= timeout_s:
        return DrainVerdict.TIMED_OUT
    return DrainVerdict.WAIT
