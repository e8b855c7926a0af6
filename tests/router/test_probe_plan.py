"""The canary plan (``integrity.probe_plan``) and the probing budget (``integrity.probe_budget``): pure rules."""

from __future__ import annotations

import itertools

import pytest
from prometheus_client import CollectorRegistry

from tandem_router.integrity.divergence import Answer
from tandem_router.integrity.probe_budget import ProbeBudget, ProbeKind, ProbeMetrics, held_s
from tandem_router.integrity.probe_plan import (
    ROTATION_BESIDE_BURSTS,
    plan_round,
    rendezvous_owner,
    rotation,
    round_number,
    rounds_to_cover,
)


def _fleet(p: int, d: int) -> list[tuple[str, str]]:
    return [(f"prefill:{i:03}", f"decode:{j:03}") for i in range(p) for j in range(d)]


@pytest.mark.parametrize(
    ("prefills", "decodes", "sample", "per_round", "cover"),
    [
        (1, 1, 2, 1, 1),
        (2, 2, 2, 4, 1),
        (8, 8, 2, 16, 4),
        (125, 125, 2, 250, 63),
        (4, 16, 2, 32, 2),
        (16, 4, 2, 32, 2),
        (3, 7, 1, 7, 3),
    ],
)
def test_rotation_scales_with_the_larger_role_and_covers_every_pair(
    prefills: int, decodes: int, sample: int, per_round: int, cover: int
) -> None:
    pairs = _fleet(prefills, decodes)
    ps, ds = sorted({p for p, _ in pairs}), sorted({d for _, d in pairs})
    assert rounds_to_cover(prefills, decodes, sample) == cover
    seen: set[tuple[str, str]] = set()
    for r in range(cover):
        one = rotation(ps, ds, r, sample)
        assert len(one) == len(set(one)) == per_round
        width = min(sample, prefills, decodes)
        for worker in (*ps, *ds):  # every worker of either role in at least ``sample`` pairs a round
            assert sum(worker in pair for pair in one) >= width
        seen |= set(one)
    assert seen == set(pairs)  # every pair within rounds_to_cover rounds


def test_rotation_is_the_same_whatever_order_the_workers_come_in() -> None:
    ps, ds = [f"prefill:{i}" for i in range(5)], [f"decode:{i}" for i in range(9)]
    assert rotation(ps, ds, 3, 2) == rotation(list(reversed(ps)), ds[::2] + ds[1::2], 3, 2)


def test_round_numbers_agree_between_routers_ticking_a_little_apart() -> None:
    assert round_number(3000.0, 30.0) == round_number(2999.2, 30.0) == round_number(3010.0, 30.0) == 100
    assert round_number(3016.0, 30.0) == 101


def test_routers_split_the_plan_without_overlap_or_gap() -> None:
    pairs = _fleet(8, 8)
    routers = ["router-a", "router-b", "router-c", "router-d"]
    plans = {r: plan_round(pairs, 5, 2, [], routers, r) for r in routers}
    together = list(itertools.chain.from_iterable(plans.values()))
    assert sorted(together) == sorted(rotation([p for p, _ in pairs], [d for _, d in pairs], 5, 2))
    assert all(plans.values())  # 16 pairs over 4 routers: each has some


def test_a_router_leaving_hands_over_only_its_own_pairs() -> None:
    pairs = _fleet(10, 10)
    before = {pair: rendezvous_owner(pair, ["a", "b", "c"]) for pair in pairs}
    after = {pair: rendezvous_owner(pair, ["a", "b"]) for pair in pairs}
    moved = {pair for pair in pairs if before[pair] != after[pair]}
    assert moved == {pair for pair in pairs if before[pair] == "c"}


def test_first_pairs_go_before_the_rotation_and_gone_pairs_are_left_out() -> None:
    pairs = _fleet(8, 8)
    suspect = ("prefill:003", "decode:006")
    gone = ("prefill:099", "decode:000")
    plan = plan_round(pairs, 0, 2, [suspect, gone], ["me"], "me")
    assert plan[0] == suspect
    assert gone not in plan
    assert len(plan) == 16 + (suspect not in rotation([p for p, _ in pairs], [d for _, d in pairs], 0, 2))


def test_beside_race_bursts_a_round_keeps_a_moving_window_of_the_rotation() -> None:
    pairs = _fleet(125, 125)
    routers = ["r0", "r1", "r2", "r3"]
    suspect = ("prefill:003", "decode:006")
    owner = rendezvous_owner(suspect, routers)
    assert owner is not None
    full = plan_round(pairs, 7, 2, [suspect], routers, owner)
    trimmed = plan_round(pairs, 7, 2, [suspect], routers, owner, ROTATION_BESIDE_BURSTS)
    assert trimmed[0] == suspect  # the first pairs are not cut
    assert len(trimmed) == 1 + ROTATION_BESIDE_BURSTS < len(full)
    assert set(trimmed) <= set(full)
    # The window moves: over the rounds the routers' windows (12 pairs a round) reach every worker of both roles.
    fleet = _fleet(40, 40)
    reached = {w for r in range(30) for who in routers for pair in plan_round(fleet, r, 2, [], routers, who, 3)
               for w in pair}  # fmt: skip
    assert reached == {w for pair in fleet for w in pair}


def test_a_probe_costs_the_time_the_decode_held_it() -> None:
    assert held_s(None, 2.6) == 2.6  # no answer: the router's time
    assert held_s(Answer("x"), 2.6) == 2.6  # no worker time (OpenAI routes): the router's
    assert held_s(Answer("x", worker_s=0.4), 2.6) == 0.4  # a busy router's own delays are not the cluster's slots
    assert held_s(Answer("x", worker_s=9.0), 2.6) == 2.6  # never more than the router saw


class Clock:
    def __init__(self) -> None:
        self.now = 0.0

    def __call__(self) -> float:
        return self.now


def test_budget_grants_share_of_capacity_in_request_seconds() -> None:
    clock = Clock()
    registry = CollectorRegistry()
    metrics = ProbeMetrics(registry)
    budget = ProbeBudget(0.01, lambda: 1000.0, metrics, clock=clock)  # 10 request-seconds a second
    assert budget.grant(ProbeKind.CANARY, 1000) == 600  # a new router: one full allowance (60 s) of 1 s probes
    assert budget.grant(ProbeKind.CANARY, 10) == 0
    clock.now = 1.0
    assert budget.grant(ProbeKind.BURST, 20) == 10
    for _ in range(10):  # they took half the time reserved: the difference comes back
        budget.settle(ProbeKind.BURST, 1.0, 0.5)
    assert budget.expected_s < 1.0
    assert budget.grant(ProbeKind.CONFIRMATION, 5) == 5
    sent = {k: registry.get_sample_value("tandem_integrity_probes_total", {"kind": k}) for k in ProbeKind}
    assert sent == {"canary": 600, "burst": 10, "confirmation": 5}


def test_a_small_cluster_still_probes_rarely() -> None:
    clock = Clock()
    budget = ProbeBudget(0.01, lambda: 1.0, ProbeMetrics(CollectorRegistry()), clock=clock)
    assert budget.grant(ProbeKind.CANARY, 4) == 3  # the bucket holds at least one round of three probes
    clock.now = 50.0
    assert budget.grant(ProbeKind.CANARY, 4) == 0  # 0.01 request-seconds a second: one 1 s probe per 100 s
    clock.now = 300.0
    assert budget.grant(ProbeKind.CANARY, 4) == 3
