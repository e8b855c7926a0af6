"""How the reconcile loop answers a failed pass. Pure.

As kopf does for its handlers (``kopf.TemporaryError`` retried after a delay, ``kopf.PermanentError`` not retried
until the object changes): a temporary failure (a lost connection, a 429 or 5xx that the Kubernetes client's own
retries did not outlast, anything unexpected) is retried after 1 s, doubling per consecutive failure up to 10 s
(kopf goes to 60 s; here a pass also recovers groups, so a long outage of the API server or etcd must not leave
them waiting a minute after it ends); a permanent one (the API server refused a request as invalid, e.g. a 422)
repeats identically until the spec changes, so it is retried every 60 s or at once on a new generation. Either way
the PDCluster says so: a ``ReconcileFailed`` condition (True with the error while failing; False once a pass
succeeds again; absent on a cluster that never failed) and a Warning Event per distinct error.
"""

from __future__ import annotations

from collections.abc import Iterable
from dataclasses import dataclass

from tandem_operator.api.common import Condition
from tandem_operator.decide.status import condition

CONDITION_TYPE = "ReconcileFailed"
FIRST_DELAY_S = 1.0
MAX_TEMPORARY_DELAY_S = 10.0
PERMANENT_DELAY_S = 60.0


@dataclass(frozen=True)
class ReconcileFailure:
    permanent: bool
    message: str  # the error, as the condition and the Event say it

    @property
    def reason(self) -> str:
        return "PermanentError" if self.permanent else "TemporaryError"


def retry_delay(consecutive: int, failure: ReconcileFailure) -> float:
    """Seconds before the next pass after ``consecutive`` failed passes in a row (the last one ``failure``)."""
    if failure.permanent:
        return PERMANENT_DELAY_S
    return min(FIRST_DELAY_S * 2.0 ** max(consecutive - 1, 0), MAX_TEMPORARY_DELAY_S)


def reconcile_condition(
    failure: ReconcileFailure | None, previous: Iterable[Condition], generation: int, now: str
) -> Condition | None:
    """The ``ReconcileFailed`` condition: None while the cluster never failed (its status does not carry one)."""
    previous = list(previous)
    if failure is None and not any(c.type == CONDITION_TYPE for c in previous):
        return None
    if failure is None:
        return condition(CONDITION_TYPE, False, "Reconciled", "the last pass succeeded", generation, previous, now)
    return condition(CONDITION_TYPE, True, failure.reason, failure.message[:1024], generation, previous, now)
