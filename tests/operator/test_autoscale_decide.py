"""The autoscaler's decider, table-tested: saturation told apart per role, hysteresis, stabilisation, missing
metrics, min/max and ratio bounds."""

from __future__ import annotations

from dataclasses import replace
from typing import Any

import pydantic
import pytest

from tandem.registry import Role
from tandem_operator.api.autoscaling import AutoscalingSpec
from tandem_operator.autoscale.decide import History, Observation, Reason, RoleLoad, decide, recommend

P, D = Role.PREFILL, Role.DECODE


def spec(**over: Any) -> AutoscalingSpec:
    body: dict[str, Any] = {
        "targets": {"ttftP90Ms": 1000, "itlP90Ms": 50},
        "prefill": {"minGroups": 1, "maxGroups": 4},
        "decode": {"minGroups": 1, "maxGroups": 4},
        "routerMetrics": ["http://router:8000/metrics"],
        "scaleUpStabilizationSeconds": 0,
        "scaleDownStabilizationSeconds": 0,
    }
    body.update(over)
    return AutoscalingSpec.model_validate(body)


def load(groups: int = 2, queue: float = 0, kv: float = 0.3, ready: int | None = None) -> RoleLoad:
    return RoleLoad(groups, groups if ready is None else ready, queue, kv, 4.0, 100.0)


def obs(
    ttft: float | None = 500, itl: float | None = 30, prefill: RoleLoad | None = None, decode: RoleLoad | None = None
) -> Observation:
    return Observation(ttft, itl, prefill or load(), decode or load())


IDLE = obs(ttft=0, itl=0, prefill=load(queue=0, kv=0), decode=load(queue=0, kv=0))

# (name, observation, (prefill desired, reason), (decode desired, reason))
CASES = [
    ("within target", obs(), (2, Reason.WITHIN_TARGET), (2, Reason.WITHIN_TARGET)),
    ("TTFT over target with prompts queued: prefill", obs(ttft=1500, prefill=load(queue=6)),
     (3, Reason.SCALE_UP), (2, Reason.WITHIN_TARGET)),
    ("ITL over target: decode only", obs(itl=90), (2, Reason.WITHIN_TARGET), (4, Reason.SCALE_UP)),
    ("TTFT over target, prefill idle, decode KV full: decode", obs(ttft=1500, decode=load(kv=0.95)),
     (2, Reason.WITHIN_TARGET), (3, Reason.SCALE_UP)),
    ("TTFT over target, prefill idle, decode has room: nobody", obs(ttft=1500),
     (2, Reason.WITHIN_TARGET), (2, Reason.WITHIN_TARGET)),
    ("growth capped at twice the groups", obs(itl=5000), (2, Reason.WITHIN_TARGET), (4, Reason.SCALE_UP)),
    ("idle: both shrink by one", IDLE, (1, Reason.SCALE_DOWN), (1, Reason.SCALE_DOWN)),
    ("hysteresis: between scaleDownBelow x target and target nothing moves", obs(ttft=700, itl=40),
     (2, Reason.WITHIN_TARGET), (2, Reason.WITHIN_TARGET)),
    ("decode quiet but its KV would not fit in one group fewer", obs(ttft=0, itl=10, decode=load(kv=0.4)),
     (1, Reason.SCALE_DOWN), (2, Reason.WITHIN_TARGET)),
    ("a request or two waiting is not queueing: both may shrink", obs(ttft=100, itl=10, prefill=load(queue=1),
     decode=load(queue=1, kv=0.1)), (1, Reason.SCALE_DOWN), (1, Reason.SCALE_DOWN)),
    ("a router unreadable: hold", obs(ttft=None, itl=90), (2, Reason.METRICS_MISSING), (2, Reason.METRICS_MISSING)),
    ("a leader unreadable: hold", obs(itl=90, decode=RoleLoad(2, 2)),
     (2, Reason.METRICS_MISSING), (2, Reason.METRICS_MISSING)),
    ("groups still starting: hold", obs(itl=90, decode=load(ready=1)),
     (2, Reason.WITHIN_TARGET), (2, Reason.SETTLING)),
    ("TTFT over target, decodes below KV full but the routers hold requests back: decode",
     replace(obs(ttft=1500), router_queued={0: 3, 10: 1}), (2, Reason.WITHIN_TARGET), (3, Reason.SCALE_UP)),
    ("idle latency while the routers hold requests back: nobody shrinks",
     replace(IDLE, router_queued={0: 4}), (2, Reason.WITHIN_TARGET), (2, Reason.WITHIN_TARGET)),
    ("one request held per two decode groups is not a queue: both may shrink",
     replace(IDLE, router_queued={0: 1}), (1, Reason.SCALE_DOWN), (1, Reason.SCALE_DOWN)),
    ("never above max", obs(itl=90, decode=load(groups=4)), (2, Reason.WITHIN_TARGET), (4, Reason.BOUNDS)),
    ("never below min", replace(IDLE, prefill=load(groups=1, kv=0), decode=load(groups=1, kv=0)),
     (1, Reason.WITHIN_TARGET), (1, Reason.WITHIN_TARGET)),
]  # fmt: skip


@pytest.mark.parametrize(("name", "seen", "prefill", "decode"), CASES, ids=[c[0] for c in CASES])
def test_decision_table(name: str, seen: Observation, prefill: tuple[int, Reason], decode: tuple[int, Reason]) -> None:
    decision = decide(spec(), seen, History(), now=100.0)
    got = {role: (v.desired, v.reason) for role, v in decision.verdicts.items()}
    assert got == {P: prefill, D: decode}, decision.verdicts


def test_out_of_bounds_groups_are_brought_back_even_without_metrics() -> None:
    seen = obs(ttft=None, decode=load(groups=9))
    verdict = decide(spec(), seen, History(), now=0.0).verdicts[D]
    assert (verdict.desired, verdict.reason) == (4, Reason.BOUNDS)
    assert "groups within [1, 4]" in verdict.message


def test_scale_up_needs_every_recommendation_of_its_window() -> None:
    s = spec(scaleUpStabilizationSeconds=30)
    hot, cool = obs(itl=90), obs(itl=40)
    history = History()
    first = decide(s, cool, history, now=0.0)
    second = decide(s, hot, first.history, now=15.0)
    assert (second.verdicts[D].desired, second.verdicts[D].reason) == (2, Reason.STABILIZING)
    third = decide(s, hot, second.history, now=31.0)  # the cool one left the window
    assert (third.verdicts[D].desired, third.verdicts[D].reason) == (4, Reason.SCALE_UP)


def test_scale_down_waits_for_its_window_and_a_spike_restarts_it() -> None:
    s = spec(scaleDownStabilizationSeconds=60)
    history = History()
    for t in (0.0, 20.0, 40.0):
        decision = decide(s, IDLE, history, now=t)
        history = decision.history
        assert decision.verdicts[D].desired == 2
        assert decision.verdicts[D].reason is Reason.STABILIZING
    spike = decide(s, obs(itl=40), history, now=50.0)  # within target: recommends 2
    history = spike.history
    assert decide(s, IDLE, history, now=100.0).verdicts[D].desired == 2  # the 2 at t=50 is in the window
    assert decide(s, IDLE, history, now=111.0).verdicts[D].desired == 1


def test_held_intervals_are_not_evidence() -> None:
    s = spec(scaleUpStabilizationSeconds=30)
    first = decide(s, obs(itl=90), History(), now=0.0)
    missing = decide(s, obs(ttft=None, itl=90), first.history, now=15.0)
    assert missing.history == first.history


def test_ratio_raises_the_lagging_role() -> None:
    s = spec(ratio={"min": 0.5, "max": 2})
    decision = decide(s, obs(itl=90, prefill=load(groups=1), decode=load(groups=2)), History(), now=0.0)
    assert decision.verdicts[D].desired == 4
    assert (decision.verdicts[P].desired, decision.verdicts[P].reason) == (2, Reason.RATIO)
    assert "ratio within [0.5, 2]" in decision.verdicts[P].message


def test_ratio_at_max_groups_trims_the_other_role() -> None:
    s = spec(ratio={"min": 1, "max": 1}, prefill={"minGroups": 1, "maxGroups": 2})
    decision = decide(s, obs(itl=90, prefill=load(groups=2), decode=load(groups=2)), History(), now=0.0)
    assert decision.verdicts[P].desired == 2
    assert decision.verdicts[D].desired == 2


def test_recommend_reports_what_it_saw() -> None:
    verdict = recommend(spec(), obs(ttft=1500, prefill=load(queue=6)), P)
    assert "TTFT p90 1500/1000 ms" in verdict.message
    assert "6 prompts queued" in verdict.message


@pytest.mark.parametrize(
    ("over", "message"),
    [
        ({"prefill": {"minGroups": 3, "maxGroups": 2}}, "minGroups must be less than or equal to maxGroups"),
        ({"ratio": {"min": 2, "max": 1}}, "min must be less than or equal to max"),
        ({"ratio": {"min": 5, "max": 6}}, "ratio cannot be met within the min and max groups"),
        ({"routerMetrics": []}, "set exactly one of routerMetrics and routerSelector"),
        ({"routerSelector": {"app.kubernetes.io/component": "router"}}, "set exactly one of routerMetrics"),
    ],
)
def test_invalid_specs_are_refused_with_the_rule_message(over: dict[str, Any], message: str) -> None:
    with pytest.raises(pydantic.ValidationError, match=message):
        spec(**over)


def test_the_first_interval_after_settling_is_not_evidence() -> None:
    starting = decide(spec(), obs(itl=200, decode=load(groups=2, ready=1)), History(), now=0.0)
    assert starting.verdicts[D].reason is Reason.SETTLING
    settled = decide(spec(), obs(itl=200), starting.history, now=15.0)  # still the old size's ITL, partly
    assert (settled.verdicts[D].desired, settled.verdicts[D].reason) == (2, Reason.SETTLING)
    measured = decide(spec(), obs(itl=200), settled.history, now=30.0)
    assert (measured.verdicts[D].desired, measured.verdicts[D].reason) == (4, Reason.SCALE_UP)


def test_the_reason_names_what_the_routers_hold_back_by_priority() -> None:
    seen = replace(obs(ttft=1500), router_queued={0: 3, 10: 1})
    verdict = decide(spec(), seen, History(), now=100.0).verdicts[D]
    assert "4 held back in the routers' queues (3 at priority 0, 1 at priority 10)" in verdict.message
