"""The PDCluster's ``IntegrityDegraded`` condition and quarantine Events from the routers' integrity reports (pure).

Each router writes one ``tandem.registry.IntegrityReport`` per PD cluster under its own etcd lease, so a router
that dies (or whose lease expires) drops out of the set by itself. A pair counts as quarantined while any live
router reports it; the condition names every quarantined pair with its reasons, and the workers all of whose
pairs are out. A pair entering the union gets one ``PairQuarantined`` Warning Event, a pair leaving it one
``PairReleased`` Normal Event; two routers reporting the same pair make one Event, not two.

A worker that a router reports as a *repeat offender* (its pairs were quarantined again and again: probation
under live load keeps failing) is not going to heal by itself: ``integrity_recreations`` names the registered
group behind it, at the incarnation the router saw, and the runtime recreates that group (fence, then the
reconcile pass replaces it with the next epoch). A report about an older incarnation is ignored.
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping
from dataclasses import dataclass
from enum import StrEnum
from typing import TypeVar

from tandem.registry import Endpoint, IntegrityReport
from tandem_operator.api.common import Condition
from tandem_operator.decide.status import condition

K = TypeVar("K")

CONDITION_TYPE = "IntegrityDegraded"
MAX_LISTED = 20  # pairs named in the condition message; the rest are counted


class Transition(StrEnum):
    QUARANTINED = "PairQuarantined"
    RELEASED = "PairReleased"


@dataclass(frozen=True, order=True)
class Pair:
    prefill: str
    decode: str

    def __str__(self) -> str:
        return f"{self.prefill} -> {self.decode}"


@dataclass(frozen=True)
class PairState:
    reasons: tuple[str, ...]  # distinct reasons, sorted
    routers: tuple[str, ...]  # reporting routers, sorted


@dataclass(frozen=True)
class IntegrityEvent:
    transition: Transition
    pair: Pair
    note: str

    @property
    def warning(self) -> bool:
        return self.transition is Transition.QUARANTINED


@dataclass(frozen=True)
class IntegrityDecision:
    condition: Condition
    events: tuple[IntegrityEvent, ...]


def quarantined(reports: Iterable[IntegrityReport]) -> dict[Pair, PairState]:
    """The union of every live router's quarantined pairs, with the reasons and routers behind each."""
    reasons: dict[Pair, set[str]] = {}
    routers: dict[Pair, set[str]] = {}
    for report in reports:
        for entry in report.quarantined:
            pair = Pair(entry.prefill, entry.decode)
            reasons.setdefault(pair, set()).add(entry.reason)
            routers.setdefault(pair, set()).add(report.router)
    return {pair: PairState(tuple(sorted(reasons[pair])), tuple(sorted(routers[pair]))) for pair in sorted(reasons)}


def suspect_workers(reports: Iterable[IntegrityReport]) -> frozenset[str]:
    """Every worker URL some live router holds in quarantine (either side of a pair, a worker all of whose pairs are
    out, a repeat offender): none of them seeds another group's weights (``spec.peerLoading``)."""
    urls: set[str] = set()
    for report in reports:
        urls.update(u for entry in report.quarantined for u in (entry.prefill, entry.decode))
        urls.update(report.quarantined_workers)
        urls.update(offender.worker for offender in report.repeat_offenders)
    return frozenset(urls)


def _workers(reports: Iterable[IntegrityReport]) -> list[str]:
    return sorted({worker for report in reports for worker in report.quarantined_workers})


def _message(pairs: Mapping[Pair, PairState], workers: list[str]) -> str:
    if not pairs and not workers:
        return "no pair quarantined"
    listed = [f"{pair} ({'; '.join(state.reasons)})" for pair, state in list(pairs.items())[:MAX_LISTED]]
    more = f", and {len(pairs) - MAX_LISTED} more" if len(pairs) > MAX_LISTED else ""
    message = f"{len(pairs)} pair(s) quarantined: {', '.join(listed)}{more}" if pairs else "0 pairs quarantined"
    if workers:
        message += f"; worker(s) with every pair quarantined: {', '.join(workers)}"
    return message


def integrity_condition(
    reports: Mapping[str, IntegrityReport], previous: Iterable[Condition], generation: int, now: str
) -> Condition:
    """``IntegrityDegraded``: True while any live router reports a quarantined pair or worker."""
    pairs, workers = quarantined(reports.values()), _workers(reports.values())
    degraded = bool(pairs or workers)
    reason = "PairsQuarantined" if degraded else "NoPairQuarantined"
    return condition(CONDITION_TYPE, degraded, reason, _message(pairs, workers), generation, previous, now)


def integrity_decision(
    before: Mapping[str, IntegrityReport],
    after: Mapping[str, IntegrityReport],
    previous: Iterable[Condition],
    generation: int,
    now: str,
) -> IntegrityDecision:
    """The condition for the reports ``after`` a change, and the Events for pairs that entered or left quarantine.

    ``before``/``after`` map a report's etcd key to the report; ``previous`` conditions keep the transition time.
    """
    was, now_out = quarantined(before.values()), quarantined(after.values())
    events = [
        IntegrityEvent(
            Transition.QUARANTINED,
            pair,
            f"pair {pair} quarantined by router(s) {', '.join(state.routers)}: {'; '.join(state.reasons)}",
        )
        for pair, state in now_out.items()
        if pair not in was
    ]
    events += [
        IntegrityEvent(Transition.RELEASED, pair, f"pair {pair} no longer quarantined by any live router")
        for pair in was
        if pair not in now_out
    ]
    return IntegrityDecision(integrity_condition(after, previous, generation, now), tuple(events))


def integrity_recreations(
    reports: Iterable[IntegrityReport], registered: Mapping[K, Endpoint], fenced: Mapping[K, int]
) -> list[tuple[K, int, str]]:
    """(group, epoch, note) for each registered group some live router reports as a repeat offender at the
    epoch it is registered with, unless that incarnation is already fenced. ``registered``/``fenced`` map the
    caller's group keys to the registered endpoint / the fenced epoch."""
    by_worker = {(ep.role, ep.url): key for key, ep in registered.items()}
    found: dict[K, tuple[K, int, str]] = {}
    for report in reports:
        for offender in report.repeat_offenders:
            key = by_worker.get((offender.role, offender.worker))
            if key is None or key in found:
                continue
            epoch = registered[key].epoch
            if offender.epoch != epoch or fenced.get(key) == epoch:
                continue
            note = (
                f"{offender.role.value} {offender.worker} (epoch {epoch}) quarantined {offender.quarantines} times "
                f"by router {report.router}; last: {offender.reason}"
            )
            found[key] = (key, epoch, note[:1000])
    return list(found.values())
