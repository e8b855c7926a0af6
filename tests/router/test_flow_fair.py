"""Table tests of the pure flow-control core: fair admission, shares, priorities, limits, capacity learning."""

from __future__ import annotations

import pytest

from tandem_router.flow.capacity import CapacityLearner
from tandem_router.flow.fair import FairQueue, Pending, Reason, Rejection
from tandem_router.flow.limits import FlowLimits, TenantLimits, parse_limits
from tandem_router.policy.load import WorkerLoad


def admitted(x: Pending | Rejection) -> Pending:
    assert isinstance(x, Pending)
    return x


def limits(**tenants: dict[str, object]) -> FlowLimits:
    return FlowLimits(tenants=tenants)


def test_unknown_capacity_admits_everything_at_once() -> None:
    q = FairQueue()
    ps = [admitted(q.offer("flood", None, 1, 0)) for _ in range(1000)]
    assert all(p.admitted for p in ps)
    assert q.in_flight == 1000
    assert q.queued == 0


def test_a_flood_leaves_slots_for_a_quiet_tenant_and_is_served_after_it() -> None:
    q = FairQueue(reserve_share=0.125, headroom_share=0.125)
    q.set_capacity(16)  # reserve 2: the flood (above its share) stops at 14; headroom 2: others may go to 18
    flood = [admitted(q.offer("flood", None, 1, 0)) for _ in range(80)]
    assert sum(p.admitted for p in flood) == 18  # alone: never above its share, it gets C + H
    for p in flood[:4]:
        q.release(p)
    assert q.in_flight == 18  # its queue refilled the slots (work-conserving)
    quiet = admitted(q.offer("quiet", None, 1, 0))
    assert not quiet.admitted  # every slot taken: it waits, first in line
    woken = q.release(flood[4])
    assert woken == [quiet]
    assert q.tenants["quiet"].in_flight == 1
    # From now on the flood is above its share: it is let in only below C - R.
    while q.in_flight > 14:
        q.release(next(p for p in flood if p.admitted and not p.done))
    assert q.in_flight == 14
    second = admitted(q.offer("quiet", None, 1, 0))
    assert second.admitted  # a slot of the reserve, at once


def test_weights_divide_a_saturated_cluster() -> None:
    q = FairQueue(limits(big={"weight": 3}), reserve_share=0.0, headroom_share=0.0)
    q.set_capacity(8)
    ps = {t: [admitted(q.offer(t, None, 1, 0)) for _ in range(40)] for t in ("big", "small")}
    for _ in range(200):  # serve in arrival order; each slot freed goes to whoever the core picks
        live = [p for t in ps for p in ps[t] if p.admitted and not p.done]
        q.release(min(live, key=lambda p: p.seq))
        for t in ps:
            ps[t] += [admitted(q.offer(t, None, 1, 0)) for _ in range(40 - sum(not p.done for p in ps[t]))]
    running = {t: sum(p.admitted and not p.done for p in ps[t]) for t in ps}
    assert running == {"big": 6, "small": 2}


def test_higher_priority_first_within_its_allowance() -> None:
    q = FairQueue(
        limits(vip={"priority": 5, "max_priority": 9}, low={"min_priority": -3}), reserve_share=0.0, headroom_share=0.0
    )
    q.set_capacity(1)
    first = admitted(q.offer("low", None, 1, 0))
    lows = [admitted(q.offer("low", asked, 1, 0)) for asked in (100, -100)]
    assert [p.priority for p in lows] == [0, -3]  # low may not raise its priority, may lower it to -3
    vip = admitted(q.offer("vip", 100, 1, 0))
    assert vip.priority == 9
    assert not vip.admitted
    assert q.queued_by_priority() == {0: 1, -3: 1, 9: 1}
    assert q.release(first) == [vip]


def test_an_idle_tenant_banks_no_credit() -> None:
    q = FairQueue(reserve_share=0.0, headroom_share=0.0)
    q.set_capacity(1)
    busy = admitted(q.offer("a", None, 100, 0))
    q.release(busy)
    for _ in range(5):
        q.release(admitted(q.offer("a", None, 100, 0)))
    assert q.tenants["a"].served == 600
    q.offer("a", None, 100, 0)  # a is busy again
    q.offer("b", None, 1, 0)
    assert q.tenants["b"].served >= 600  # starts at the busy tenants' counter, not at 0


def test_a_tenant_let_in_from_its_queue_keeps_its_share() -> None:
    """A quiet tenant's request that queues behind a flood's queue and is let in from nothing in flight used to
    count the tenant busy twice: the busy weight grew with every such request, every share shrank towards 0, and the
    quiet tenant, seen above its share, waited for the flood's slots (bench: 299 of 443 quiet requests queued)."""
    q = FairQueue(reserve_share=0.25, headroom_share=0.5)
    q.set_capacity(16)  # headroom 8, reserve 4
    flood = [admitted(q.offer("flood", None, 1, 0)) for _ in range(80)]
    for _ in range(50):
        quiet = admitted(q.offer("quiet", None, 1, 0))
        assert not quiet.admitted  # 24 in flight: it waits, first in line
        assert q.release(next(p for p in flood if p.admitted and not p.done)) == [quiet]
        q.release(quiet)
    assert q._busy_weight == 1  # the flood alone
    assert q.share(q.tenants["quiet"]) == 12  # (16 + 8) / 2 once it is busy
    while q.in_flight > 12:  # the flood, above its share, drains to C - R
        q.release(next(p for p in flood if p.admitted and not p.done))
    again = [admitted(q.offer("quiet", None, 1, 0)) for _ in range(4)]
    assert all(p.admitted for p in again)  # below its share: let in at once, ahead of the flood's queue


def test_an_idle_tenant_keeps_its_share_a_moment() -> None:
    """Between two of a quiet tenant's requests (or while its client stalls) the flood stays at C - R: it does
    not take the quiet tenant's slots and hold them for a whole request. After ``linger_s`` the share goes back."""
    q = FairQueue(reserve_share=0.25, headroom_share=0.25, linger_s=0.5)
    q.set_capacity(16)  # reserve 4, headroom 4
    quiet = admitted(q.offer("quiet", None, 1, 0))
    flood = [admitted(q.offer("flood", None, 1, 0)) for _ in range(80)]
    assert q.in_flight == 12  # the flood, above its share (20 / 2), stops at C - R
    assert len(q.release(quiet, now=10.0)) == 1  # its slot: the flood back to C - R, no further
    assert q.in_flight == 12
    assert q.share(q.tenants["flood"]) == 10  # quiet idle now, but counted for 0.5 s more
    assert q.expire(10.4) == []
    back = admitted(q.offer("quiet", None, 1, 10.45))
    assert back.admitted  # below its share: at once
    assert q.release(back, now=10.5) == []
    woken = q.expire(11.0)  # its share lapsed: the flood, alone, goes to C + H
    assert len(woken) == 8
    assert q.in_flight == 20
    assert q._busy_weight == 1
    assert sum(p.admitted for p in flood) == 20


@pytest.mark.parametrize(
    ("entry", "reason", "retry_after"),
    [
        ({"max_concurrency": 2}, Reason.CONCURRENCY, 1.0),
        ({"requests_per_minute": 2}, Reason.REQUESTS_PER_MINUTE, 30.0),
        ({"tokens_per_second": 200}, Reason.TOKENS_PER_SECOND, 0.5),  # 2 x 150 tokens: 100 in debt
    ],
)
def test_limits_refuse_with_retry_after(entry: dict[str, object], reason: Reason, retry_after: float) -> None:
    q = FairQueue(limits(t=entry))
    assert isinstance(q.offer("t", None, 150, 0), Pending)
    assert isinstance(q.offer("t", None, 150, 0), Pending)
    refused = q.offer("t", None, 150, 0)
    assert isinstance(refused, Rejection)
    assert refused.reason is reason
    assert refused.retry_after_s == pytest.approx(retry_after, rel=0.01)
    assert isinstance(q.offer("other", None, 150, 0), Pending)  # other tenants are not limited


def test_a_full_queue_refuses_and_a_cancelled_request_leaves_it() -> None:
    q = FairQueue(limits(t={"max_queued": 1}), reserve_share=0.0, headroom_share=0.0)
    q.set_capacity(1)
    running = admitted(q.offer("t", None, 1, 0))
    waiting = admitted(q.offer("t", None, 1, 0))
    refused = q.offer("t", None, 1, 0)
    assert isinstance(refused, Rejection)
    assert refused.reason is Reason.QUEUE_FULL
    q.cancel(waiting)
    assert q.queued == 0
    assert q.release(running) == []
    assert not q._busy
    assert q._busy_weight == 0


def test_release_and_cancel_count_once() -> None:
    q = FairQueue()
    p = admitted(q.offer("t", None, 1, 0))
    q.release(p)
    q.release(p)
    q.cancel(p)
    assert q.in_flight == 0
    assert q.tenants["t"].in_flight == 0


def test_reloaded_limits_apply_to_known_tenants() -> None:
    q = FairQueue()
    q.offer("t", None, 1, 0)
    q.set_limits(limits(t={"max_concurrency": 1}))
    refused = q.offer("t", None, 1, 0)
    assert isinstance(refused, Rejection)
    assert refused.reason is Reason.CONCURRENCY


def test_capacity_is_learned_from_saturated_decodes() -> None:
    learner = CapacityLearner()
    learner.observe("d1", WorkerLoad(running=3))
    assert learner.capacity(["d1"]) is None  # never saturated: unknown
    saturated = WorkerLoad(running=8, queued=5)
    learner.observe("d1", saturated)
    learner.observe("d2", WorkerLoad(running=6, kv_usage=0.97))
    assert learner.capacity(["d1", "d2"]) == 14
    learner.observe("d1", saturated)  # the same scrape read again (the tick is faster than the scrapes)
    learner.observe("d2", WorkerLoad(running=1, queued=1))  # one sample between two requests: a partial step
    assert learner.estimates["d2"] == pytest.approx(6 - 0.3 * 5)
    learner.observe("d1", WorkerLoad(running=10))  # it held more than seen saturated: raised
    assert learner.capacity(["d1", "d2"]) == round(10 + 4.5)
    assert learner.capacity(["d1"]) == 10  # a decode out of routing takes its share out
    learner.forget_except(["d2"])
    assert learner.capacity(["d1", "d2"]) is None


def test_a_saturated_sample_above_the_capacity_raises_it_at_once() -> None:
    """Scrapes that fall between two requests (a slot freed, its successor not in it yet) move the capacity down;
    the next full one puts it back, rather than a third of the way back (which left it at 9-13 of 16 on a busy
    machine, and a lone tenant held below what the decodes run)."""
    learner = CapacityLearner()
    learner.observe("d1", WorkerLoad(running=8, queued=3))
    for _ in range(3):
        learner.observe("d1", WorkerLoad(running=5, queued=1))
        learner.observe("d1", WorkerLoad(running=8, queued=2))
        assert learner.estimates["d1"] == 8


def test_a_scrape_of_a_decode_below_its_capacity_is_not_saturation() -> None:
    """A decode held below its capacity by flow control counts a request queued while it takes its reservation, and
    a simulated decode keeps its KV cache 99.7 % full after its clients left; taken as saturation, such scrapes
    lowered the capacity, and flow control held the decodes lower still (9-13 of 16 learned)."""
    learner = CapacityLearner()
    learner.sample("d1", WorkerLoad(running=8, queued=3))
    for _ in range(10):
        learner.sample("d1", WorkerLoad(running=5, queued=1))  # 6 of 8: a request on its way into a free slot
    assert learner.estimates["d1"] == 8
    learner.sample("d1", WorkerLoad(running=6, queued=3))  # 9 held, 6 run: it runs fewer now (longer requests)
    assert learner.estimates["d1"] == pytest.approx(8 - 0.3 * 2)
    learner.sample("d1", WorkerLoad(running=0, kv_usage=0.997))  # idle, its KV held by nothing of ours
    assert learner.estimates["d1"] == pytest.approx(7.4)
    learner.sample("d1", WorkerLoad(running=4, queued=1, kv_usage=0.97))  # requests wait on a full KV cache
    assert learner.estimates["d1"] == pytest.approx(7.4 - 0.3 * 3.4)


def test_tenant_entries_merge_over_the_default() -> None:
    parsed = parse_limits("default: {weight: 2, max_queued: 5}\ntenants:\n  'key:ab': {priority: 3}\n", "f")
    resolved = parsed.resolved()["key:ab"]
    assert (resolved.weight, resolved.max_queued, resolved.priority) == (2, 5, 3)
    assert resolved.effective_priority(None) == 3


@pytest.mark.parametrize(
    ("text", "names"),
    [
        ("default: {weight: 0}", "f: default.weight: Input should be greater than 0"),
        ("tenants: {a: {weight: -1}}", "f: tenants.a.weight: Input should be greater than 0"),
        ("tenants: {a: {burst: 3}}", "f: tenants.a.burst: Extra inputs are not permitted"),
        ("tenants: {a: {priority: 5, max_priority: 1}}", "f: tenants.a: Value error, min_priority <= priority"),
        ("defaults: {}", "f: defaults: Extra inputs are not permitted"),
        ("[1, 2]", "f: expected a mapping"),
        ("a: [", "f: not YAML/JSON"),
    ],
)
def test_a_malformed_file_is_refused_naming_the_field(text: str, names: str) -> None:
    from tandem_router.flow.limits import LimitsError

    with pytest.raises(LimitsError) as err:
        parse_limits(text, "f")
    assert str(err.value).startswith(names)


def test_tenant_limits_defaults_are_unlimited() -> None:
    lim = TenantLimits()
    assert lim.max_concurrency is lim.tokens_per_second is lim.requests_per_minute is None


def test_a_quiet_tenant_between_two_requests_finds_its_slots_free() -> None:
    q = FairQueue(reserve_share=0.125, headroom_share=0.0, linger_s=0.5)
    q.set_capacity(16)  # reserve 2; 5 busy tenants: a share of 3.2 each
    quiet = {t: [admitted(q.offer(t, None, 1, 0.0)) for _ in range(2)] for t in ("a", "b", "c", "d")}
    flood = [admitted(q.offer("flood", None, 1, 0.0)) for _ in range(40)]
    assert sum(p.admitted for p in flood) == 6  # above its share: up to C - R = 14 in flight in all
    for t in ("a", "b", "c"):  # three quiet streams end a request each; their next ones are on the way
        q.release(quiet[t][0], 0.1)
    assert q.held() == 3
    assert sum(p.admitted for p in flood) == 6  # the flood does not take the slots they will want back
    back = [admitted(q.offer(t, None, 1, 0.15)) for t in ("a", "b", "c")]
    assert all(p.admitted for p in back)
    assert q.in_flight == 14  # C - R again: nobody queues on a decode behind the flood, the reserve still free
    # Their demand lapses after the linger: quiet tenants that stay at one request hold nothing more.
    for p in back:
        q.release(p, 0.2)
    q.expire(0.8)
    assert q.held() == 0
    assert sum(p.admitted for p in flood) == 9  # the flood, still above its share, takes the 3 slots left
