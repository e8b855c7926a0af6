"""Race bursts (``integrity.race_plan``), the budget's split between routers and the capacity estimate the budget
counts before flow control learned one: pure rules."""

from __future__ import annotations

import pytest
from prometheus_client import CollectorRegistry

from tandem_router.integrity import race_plan
from tandem_router.integrity.probe_budget import ProbeBudget, ProbeKind, ProbeMetrics
from tandem_router.policy.load import WorkerLoad
from tandem_router.probes.hooks import estimated_capacity

DECODES = [f"decode:{j:03}" for j in range(125)]
ROUTERS = ["r0", "r1", "r2", "r3"]


def test_prompts_are_distinct_and_one_short_of_every_page_size_up_to_64() -> None:
    prompts = race_plan.prompts()
    assert len(set(prompts)) == len(prompts) == race_plan.BURST
    for prompt in prompts:
        words = len(prompt.split())
        assert words == race_plan.PROMPT_WORDS
        assert all((words + 1) % page == 0 for page in (16, 32, 64))


def test_every_decode_has_exactly_one_owner_and_a_leaver_hands_only_its_own_over() -> None:
    mine = {r: race_plan.my_decodes(DECODES, ROUTERS, r) for r in ROUTERS}
    assert sorted(d for ds in mine.values() for d in ds) == DECODES
    assert all(15 <= len(ds) <= 50 for ds in mine.values())  # a hash split, roughly even
    after = {r: race_plan.my_decodes(DECODES, ROUTERS[:3], r) for r in ROUTERS[:3]}
    for r in ROUTERS[:3]:
        assert set(mine[r]) <= set(after[r])
        assert set(after[r]) - set(mine[r]) <= set(mine["r3"])


@pytest.mark.parametrize("decodes", [DECODES, DECODES[:8], DECODES[:1], []])
def test_budget_weights_of_a_cluster_sum_to_one(decodes: list[str]) -> None:
    weights = [race_plan.budget_weight(decodes, ROUTERS, r) for r in ROUTERS]
    assert sum(weights) == pytest.approx(1.0)
    if len(decodes) == 1:
        assert sorted(weights) == [0.0, 0.0, 0.0, 1.0]  # the lone decode's prober holds the whole budget


def test_a_router_not_registered_yet_counts_itself() -> None:
    assert race_plan.budget_weight(DECODES[:1], [], "r0") == 1.0
    assert race_plan.my_decodes(DECODES[:2], [], "r0") == DECODES[:2]


@pytest.mark.parametrize(
    ("last", "suspects", "expected"),
    [
        (None, set(), "d1"),
        ("d1", set(), "d2"),
        ("d3", set(), "d1"),  # wraps round
        ("d0", set(), "d1"),  # a decode no longer mine: the next one after it
        ("d9", set(), "d1"),
        ("d1", {"d1"}, "d1"),  # a lone suspect goes again
        ("d1", {"d1", "d3"}, "d3"),  # suspects first, and two of them alternate
        ("d3", {"d1", "d3"}, "d1"),
        ("d2", {"d1"}, "d1"),
    ],
)
def test_next_decode_sweeps_in_order_with_suspects_first(last: str | None, suspects: set[str], expected: str) -> None:
    assert race_plan.next_decode(["d1", "d2", "d3"], suspects, last) == expected


def test_next_decode_without_decodes() -> None:
    assert race_plan.next_decode([], {"d1"}, "d1") is None


def test_burst_prefills_are_distinct_and_rotate_over_every_prefill() -> None:
    prefills = [f"p{i}" for i in range(8)]
    seen: set[str] = set()
    for turn in range(3):
        chosen = race_plan.burst_prefills(prefills, turn)
        assert len(set(chosen)) == len(chosen) == race_plan.BURST
        seen |= set(chosen)
    assert seen == set(prefills)
    assert race_plan.burst_prefills(["p0"], 5) == ["p0"] * race_plan.BURST  # a lone prefill: its pair, each time
    assert race_plan.burst_prefills([], 0) == []


@pytest.mark.parametrize(("prefills", "decodes"), [(125, 125), (8, 8), (40, 7), (3, 50)])
def test_one_sweep_of_the_decodes_goes_through_every_prefill(prefills: int, decodes: int) -> None:
    ps = [f"p{i:03}" for i in range(prefills)]
    ds = [f"d{i:03}" for i in range(decodes)]
    first = {p for d in ds for p in race_plan.burst_prefills(ps, race_plan.first_turn(d, ds))}
    assert len(first) == min(prefills, race_plan.BURST * decodes)
    assert race_plan.first_turn("d-new", ds) == 0  # a decode not listed yet counts itself


def test_sweep_bound() -> None:
    assert race_plan.sweep_s(31, 0.6, 2.5) == pytest.approx(7.44)
    assert race_plan.sweep_s(0, 0.6, 0.0) == 0.0
    assert race_plan.sweep_s(1, 0.6, 0.0) == float("inf")


def test_the_budget_fills_at_the_routers_weight() -> None:
    now = [0.0]
    weight = [0.25]
    budget = ProbeBudget(
        0.01, lambda: 1000.0, ProbeMetrics(CollectorRegistry()), clock=lambda: now[0], weight=lambda: weight[0]
    )
    budget.expected_s = 0.5
    assert budget.grant(ProbeKind.BURST, 1000) == 300  # 60 s of 2.5 request-seconds a second
    now[0] = 10.0
    assert budget.grant(ProbeKind.BURST, 1000) == 50  # 10 s at 2.5
    weight[0] = 0.0
    now[0] = 20.0
    assert budget.grant(ProbeKind.BURST, 1000) == 0  # a router without decodes to sweep has no budget left


@pytest.mark.parametrize(
    ("loads", "expected"),
    [
        ([WorkerLoad(running=2, kv_usage=0.25), WorkerLoad(running=1, kv_usage=0.125)], 16.0),
        ([WorkerLoad(running=2, kv_usage=0.25), WorkerLoad()], 16.0),  # an idle decode counts the typical one
        ([WorkerLoad(), WorkerLoad()], 2.0),  # nothing to tell from: one each
        ([WorkerLoad(running=3, kv_usage=0.001)], 3.0),  # too little KV in use to extrapolate: what it runs
        ([WorkerLoad(running=4, kv_usage=1.0, queued=5)], 4.0),
        ([], 0.0),
    ],
)
def test_estimated_capacity(loads: list[WorkerLoad], expected: float) -> None:
    assert estimated_capacity(loads) == pytest.approx(expected)
