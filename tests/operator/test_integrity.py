"""The IntegrityDegraded condition and quarantine Events from routers' integrity reports (pure, table tests)."""

from __future__ import annotations

import pytest

from tandem.registry import Endpoint, IntegrityReport, QuarantinedPair, RepeatOffender, Role
from tandem_operator.api.common import Condition, ConditionStatus
from tandem_operator.decide.integrity import (
    MAX_LISTED,
    Pair,
    Transition,
    integrity_condition,
    integrity_decision,
    integrity_recreations,
)

P0, P1 = "http://10.0.0.1:30000", "http://10.0.0.2:30000"
D0, D1 = "http://10.0.1.1:30001", "http://10.0.1.2:30001"
T0, T1 = "2026-11-30T07:00:00Z", "2026-11-30T07:05:00Z"


def report(router: str, *pairs: tuple[str, str, str], workers: tuple[str, ...] = ()) -> IntegrityReport:
    quarantined = tuple(QuarantinedPair(prefill=p, decode=d, reason=r, since_s=1.0) for p, d, r in pairs)
    return IntegrityReport(router=router, quarantined=quarantined, quarantined_workers=workers)


def reports(*items: IntegrityReport) -> dict[str, IntegrityReport]:
    return {f"/tandem/v1/clusters/ns/c/integrity/{r.router}": r for r in items}


CLEAN = reports(report("r1"), report("r2"))
ONE = reports(report("r1", (P0, D1, "prompt leak")), report("r2"))
SAME_PAIR_TWICE = reports(report("r1", (P0, D1, "prompt leak")), report("r2", (P0, D1, "canary mismatch")))
TWO = reports(report("r1", (P0, D1, "prompt leak"), (P1, D1, "repetition loop")))


@pytest.mark.parametrize(
    ("before", "after", "status", "reason", "in_message", "events"),
    [
        ({}, {}, "False", "NoPairQuarantined", ["no pair quarantined"], []),
        (CLEAN, CLEAN, "False", "NoPairQuarantined", ["no pair quarantined"], []),
        (CLEAN, ONE, "True", "PairsQuarantined", ["1 pair(s)", f"{P0} -> {D1} (prompt leak)"], [("Q", P0, D1)]),
        (ONE, ONE, "True", "PairsQuarantined", ["prompt leak"], []),  # no Event while nothing changes
        # two routers reporting one pair: one pair, both reasons, no second Event
        (ONE, SAME_PAIR_TWICE, "True", "PairsQuarantined", ["1 pair(s)", "canary mismatch; prompt leak"], []),
        (CLEAN, SAME_PAIR_TWICE, "True", "PairsQuarantined", ["1 pair(s)"], [("Q", P0, D1)]),
        # one of two reporters drops the pair (or its lease expired): still quarantined by the other
        (SAME_PAIR_TWICE, reports(report("r2", (P0, D1, "canary mismatch"))), "True", "PairsQuarantined", [], []),
        (ONE, CLEAN, "False", "NoPairQuarantined", ["no pair quarantined"], [("R", P0, D1)]),
        # the only reporting router's key is gone (lease expired): the pair stops counting
        (ONE, {}, "False", "NoPairQuarantined", ["no pair quarantined"], [("R", P0, D1)]),
        (ONE, TWO, "True", "PairsQuarantined", ["2 pair(s)", "repetition loop"], [("Q", P1, D1)]),
        (TWO, ONE, "True", "PairsQuarantined", ["1 pair(s)"], [("R", P1, D1)]),
        (
            CLEAN,
            reports(report("r1", (P0, D1, "prompt leak"), (P1, D1, "prompt leak"), workers=(D1,))),
            "True",
            "PairsQuarantined",
            [f"worker(s) with every pair quarantined: {D1}"],
            [("Q", P0, D1), ("Q", P1, D1)],
        ),
    ],
)
def test_condition_and_events(
    before: dict[str, IntegrityReport],
    after: dict[str, IntegrityReport],
    status: str,
    reason: str,
    in_message: list[str],
    events: list[tuple[str, str, str]],
) -> None:
    decision = integrity_decision(before, after, [], 3, T0)
    cond = decision.condition
    assert (cond.type, cond.status.value, cond.reason, cond.observed_generation) == (
        "IntegrityDegraded",
        status,
        reason,
        3,
    )
    for text in in_message:
        assert text in cond.message, cond.message
    kinds = {"Q": Transition.QUARANTINED, "R": Transition.RELEASED}
    assert [(e.transition, e.pair) for e in decision.events] == [(kinds[k], Pair(p, d)) for k, p, d in events]


def test_event_notes_name_the_pair_routers_and_reasons() -> None:
    (entered,) = integrity_decision(CLEAN, SAME_PAIR_TWICE, [], 1, T0).events
    assert entered.warning
    assert entered.note == f"pair {P0} -> {D1} quarantined by router(s) r1, r2: canary mismatch; prompt leak"
    (left,) = integrity_decision(SAME_PAIR_TWICE, CLEAN, [], 1, T0).events
    assert not left.warning
    assert left.note == f"pair {P0} -> {D1} no longer quarantined by any live router"


def test_transition_time_is_kept_while_the_status_stays() -> None:
    earlier = Condition(
        type="IntegrityDegraded", status=ConditionStatus.TRUE, reason="PairsQuarantined", last_transition_time=T0
    )
    assert integrity_condition(TWO, [earlier], 1, T1).last_transition_time == T0
    assert integrity_condition(CLEAN, [earlier], 1, T1).last_transition_time == T1


def test_a_long_list_is_cut_and_counted() -> None:
    many = reports(report("r1", *((f"http://10.0.0.{i}:30000", D0, "prompt leak") for i in range(MAX_LISTED + 5))))
    message = integrity_condition(many, [], 1, T0).message
    assert message.startswith(f"{MAX_LISTED + 5} pair(s) quarantined")
    assert message.endswith(", and 5 more")
    assert message.count(" -> ") == MAX_LISTED


def _offending(router: str, role: Role, worker: str, epoch: int) -> IntegrityReport:
    offender = RepeatOffender(role=role, worker=worker, epoch=epoch, quarantines=3, reason="failed on probation")
    return IntegrityReport(router=router, repeat_offenders=(offender,))


def _endpoint(role: Role, url: str, epoch: int) -> Endpoint:
    return Endpoint(role=role, group=f"{role.value}-0", url=url, model="m", epoch=epoch)


def test_a_repeat_offender_group_is_recreated_once_per_incarnation() -> None:
    registered = {"decode-1": _endpoint(Role.DECODE, D1, 4), "prefill-0": _endpoint(Role.PREFILL, P0, 1)}
    both = [_offending("r1", Role.DECODE, D1, 4), _offending("r2", Role.DECODE, D1, 4)]
    [(group, epoch, note)] = integrity_recreations(both, registered, {})
    assert (group, epoch) == ("decode-1", 4)
    assert "quarantined 3 times by router r1" in note
    assert integrity_recreations(both, registered, {"decode-1": 4}) == []  # already fenced
    assert integrity_recreations(both, {**registered, "decode-1": _endpoint(Role.DECODE, D1, 5)}, {}) == []
    assert integrity_recreations([_offending("r1", Role.PREFILL, D1, 4)], registered, {}) == []  # wrong role
    assert integrity_recreations([_offending("r1", Role.DECODE, D0, 0)], registered, {}) == []  # not registered
