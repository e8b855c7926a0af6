"""Table tests of the pure routing decisions: selection, breakers, retries, bootstrap fields, load parsing."""

from __future__ import annotations

import random
from collections import Counter

import pytest

from tandem.registry import Role
from tandem_router.openai.schema import Route, item_count, prompt_text
from tandem_router.policy import bootstrap, retry
from tandem_router.policy import breaker as br
from tandem_router.policy import selection as sel
from tandem_router.policy.load import WorkerLoad, parse_sglang_metrics
from tandem_router.pool import Pair, WorkerPool, WorkerSpec

C = sel.Candidate


@pytest.mark.parametrize(("counter", "expected"), [(0, 0), (1, 1), (2, 2), (3, 0), (7, 1)])
def test_round_robin(counter: int, expected: int) -> None:
    assert sel.round_robin(3, counter) == expected


@pytest.mark.parametrize(
    ("loads", "expected"),
    [
        ([0], {0}),
        ([5, 1], {1}),
        ([1, 5], {0}),
        ([3, 3], {0, 1}),
        ([9, 0, 9], {0, 1, 2}),  # two random draws: the idle one wins whenever drawn
    ],
)
def test_power_of_two_picks_the_less_loaded_of_two(loads: list[int], expected: set[int]) -> None:
    cands = [C(str(i), in_flight=n) for i, n in enumerate(loads)]
    rng = random.Random(1)
    picks = {sel.power_of_two(cands, rng) for _ in range(200)}
    assert picks <= expected
    if len(loads) == 3:
        # the most loaded pair can be drawn, but the idle worker wins every draw it is part of (2/3 of draws)
        counts = Counter(sel.power_of_two(cands, rng) for _ in range(3000))
        assert 1800 < counts[1] < 2200


@pytest.mark.parametrize(
    ("cands", "expected"),
    [
        ([C("a", 2), C("b", 1)], 1),
        ([C("a", 1, kv_usage=0.9), C("b", 4, kv_usage=0.0)], 1),  # 1 + 14.4 > 4
        ([C("a", 1, kv_usage=0.05), C("b", 2, kv_usage=0.0)], 0),  # 1.8 < 2
        ([C("a", 0, queued=5), C("b", 3)], 1),
    ],
)
def test_load_aware_decode(cands: list[sel.Candidate], expected: int) -> None:
    assert sel.load_aware_decode(cands) == expected


CFG = br.BreakerConfig(threshold=3, cooldown=1.0, max_cooldown=4.0)


def test_breaker_opens_after_threshold_then_half_opens_and_closes() -> None:
    b = br.Breaker()
    for _ in range(2):
        b = br.on_failure(b, 0.0, CFG)
    assert b.state is br.BreakerState.CLOSED
    b = br.on_failure(b, 10.0, CFG)
    assert b.state is br.BreakerState.OPEN
    assert not br.allows(b, 10.5)
    assert br.allows(b, 11.0)
    b = br.on_dispatch(b, 11.0)
    assert b.state is br.BreakerState.HALF_OPEN
    assert not br.allows(b, 11.0)  # one trial at a time
    assert br.on_success(b) == br.Breaker()


def test_breaker_failed_trial_doubles_cooldown_up_to_max() -> None:
    b = br.force_open(br.Breaker(), 0.0, CFG)
    cooldowns = []
    now = 0.0
    for _ in range(4):
        now += b.cooldown
        b = br.on_failure(br.on_dispatch(b, now), now, CFG)
        cooldowns.append(b.cooldown)
    assert cooldowns == [2.0, 4.0, 4.0, 4.0]
    assert b.state is br.BreakerState.OPEN


def test_success_resets_failure_count() -> None:
    b = br.on_failure(br.on_failure(br.Breaker(), 0, CFG), 0, CFG)
    assert br.on_failure(br.on_success(b), 0, CFG).state is br.BreakerState.CLOSED


@pytest.mark.parametrize(
    ("status", "retryable"),
    [
        (408, True),
        (429, True),
        (500, True),
        (502, True),
        (503, True),
        (504, True),
        (400, False),
        (404, False),
        (501, False),
    ],
)
def test_retryable_statuses(status: int, retryable: bool) -> None:
    assert retry.is_retryable_status(status) is retryable


def test_retry_budget_and_backoff() -> None:
    cfg = retry.RetryConfig(max_attempts=3, initial_backoff=0.1, multiplier=2.0, max_backoff=0.3, jitter=0.2)
    assert retry.should_retry(1, cfg, first_byte_sent=False)
    assert not retry.should_retry(3, cfg, first_byte_sent=False)
    assert not retry.should_retry(1, cfg, first_byte_sent=True)
    rng = random.Random(0)
    for attempt, base in [(1, 0.1), (2, 0.2), (3, 0.3), (6, 0.3)]:
        for _ in range(50):
            assert base * 0.8 <= retry.backoff(attempt, cfg, rng) <= base * 1.2


@pytest.mark.parametrize("dp", [1, 2, 8])
def test_rooms_are_in_range_and_match_the_dp_rank(dp: int) -> None:
    rng = random.Random(3)
    rooms = [bootstrap.new_room(rng, dp) for _ in range(500)]
    assert all(0 <= r <= bootstrap.MAX_ROOM for r in rooms)
    assert len(set(rooms)) == 500
    assert {r % dp for r in rooms} == set(range(dp))
    assert all(bootstrap.new_room(rng, dp, dp_rank=1) % dp == 1 % dp for _ in range(50))


def test_inject_single_and_batch() -> None:
    rng = random.Random(0)
    body = {"text": "x", "extra": {"keep": True}}
    one = bootstrap.inject(body, host="10.0.0.1", port=8998, items=0, rng=rng)
    assert one["bootstrap_host"] == "10.0.0.1"
    assert one["bootstrap_port"] == 8998
    assert isinstance(one["bootstrap_room"], int)
    assert one["extra"] == {"keep": True}
    assert "bootstrap_room" not in body  # the client's body is not modified
    batch = bootstrap.inject(body, host="h", port=None, items=3, rng=rng)
    assert batch["bootstrap_host"] == ["h"] * 3
    assert batch["bootstrap_port"] == [None] * 3
    assert len(set(batch["bootstrap_room"])) == 3
    assert bootstrap.bootstrap_host("http://[fd00::1]:30000") == "fd00::1"


@pytest.mark.parametrize(
    ("route", "body", "items"),
    [
        (Route.CHAT, {"messages": []}, 0),
        (Route.CHAT, {"n": 4}, 4),
        (Route.COMPLETIONS, {"prompt": "a"}, 0),
        (Route.COMPLETIONS, {"prompt": [1, 2, 3]}, 0),  # token ids of one prompt
        (Route.COMPLETIONS, {"prompt": [[1], [2]]}, 2),
        (Route.COMPLETIONS, {"prompt": ["a", "b"], "n": 3}, 6),
        (Route.GENERATE, {"text": "a"}, 0),
        (Route.GENERATE, {"text": ["a", "b"]}, 2),
        (Route.GENERATE, {"input_ids": [1, 2]}, 0),
        (Route.GENERATE, {"input_ids": [[1], [2], [3]]}, 3),
        (Route.GENERATE, {"text": "a", "sampling_params": {"n": 2}}, 2),
    ],
)
def test_item_count(route: Route, body: dict[str, object], items: int) -> None:
    assert item_count(route, body) == items


def test_prompt_text() -> None:
    chat = {"messages": [{"role": "system", "content": "S"}, {"role": "user", "content": "U"}]}
    assert prompt_text(Route.CHAT, chat) == "S\nU"
    assert prompt_text(Route.GENERATE, {"text": ["first", "second"]}) == "first"
    assert prompt_text(Route.COMPLETIONS, {"prompt": "x" * 5000}, limit=10) == "x" * 10


def test_parse_sglang_metrics() -> None:
    text = """# HELP sglang:num_running_reqs running
# TYPE sglang:num_running_reqs gauge
sglang:num_running_reqs{dp_rank="0"} 3
sglang:num_running_reqs{dp_rank="1"} 4
# TYPE sglang:num_queue_reqs gauge
sglang:num_queue_reqs{dp_rank="0"} 2
# TYPE sglang:kv_used_tokens gauge
sglang:kv_used_tokens 250
# TYPE sglang:max_total_num_tokens gauge
sglang:max_total_num_tokens 1000
# TYPE other_metric gauge
other_metric 99
"""
    assert parse_sglang_metrics(text) == WorkerLoad(running=7, queued=2, kv_usage=0.25)
    assert parse_sglang_metrics("") == WorkerLoad()
    usage = '# TYPE sglang:token_usage gauge\nsglang:token_usage{a="0"} 0.5\nsglang:token_usage{a="1"} 0.7\n'
    assert parse_sglang_metrics(usage).kv_usage == pytest.approx(0.6)


def _pool(prefills: int, decodes: int) -> WorkerPool:
    pool = WorkerPool(sel.Policy.ROUND_ROBIN, br.BreakerConfig(threshold=1, cooldown=10))
    pool.replace_all(
        [WorkerSpec(Role.PREFILL, f"http://p{i}:1", 8998) for i in range(prefills)]
        + [WorkerSpec(Role.DECODE, f"http://d{i}:1") for i in range(decodes)]
    )
    return pool


class QuarantineGate:
    """A gate like the integrity checks will add: vetoes one pair."""

    def __init__(self, banned: tuple[str, str]) -> None:
        self.banned = banned
        self.seen: list[tuple[tuple[str, str], bool]] = []

    def allows(self, pair: Pair, now: float) -> bool:
        return pair.key != self.banned

    def record(self, pair: Pair, ok: bool, now: float) -> None:
        self.seen.append((pair.key, ok))


def test_pool_never_offers_decode_without_prefill() -> None:
    pool = _pool(1, 2)
    pool.record_worker(pool.of_role(Role.PREFILL)[0].spec, False, 0.0, hard=True)
    assert pool.choose_pair("", 1.0) is None
    assert not pool.has_healthy_pair(1.0)
    assert pool.choose_pair("", 11.0) is not None  # cooldown over: one trial


def test_pool_excludes_tried_pairs_open_pairs_and_gated_pairs() -> None:
    pool = _pool(2, 2)
    p0, p1 = (w.spec for w in pool.of_role(Role.PREFILL))
    d0, d1 = (w.spec for w in pool.of_role(Role.DECODE))
    gate = QuarantineGate((p0.key, d0.key))
    pool.gates.append(gate)
    seen = {pool.choose_pair("", 0.0).key for _ in range(20)}  # type: ignore[union-attr]
    assert (p0.key, d0.key) not in seen
    assert len(seen) == 3
    pool.record_pair(Pair(p1, d1), False, 0.0)  # threshold 1: the pair opens, both workers stay usable
    assert gate.seen == [((p1.key, d1.key), False)]
    seen = {pool.choose_pair("", 1.0).key for _ in range(20)}  # type: ignore[union-attr]
    assert seen == {(p0.key, d1.key), (p1.key, d0.key)}
    exclude = frozenset({(p0.key, d1.key)})
    assert {pool.choose_pair("", 1.0, exclude).key for _ in range(10)} == {(p1.key, d0.key)}  # type: ignore[union-attr]


def test_a_worker_back_after_refusing_connections_starts_its_pairs_afresh() -> None:
    pool = _pool(1, 1)
    prefill, decode = pool.of_role(Role.PREFILL)[0].spec, pool.of_role(Role.DECODE)[0].spec
    pair = Pair(prefill, decode)
    for t in range(6):  # failed trials while the decode was down: the pair's cooldown doubled each time
        pool.record_pair(pair, False, float(t))
    assert not pool.pair_breakers.allows(pair, 6.0)
    pool.record_worker(decode, True, 6.0)  # answering, but never refused: same process, history kept
    assert not pool.pair_breakers.allows(pair, 6.0)
    pool.record_worker(decode, False, 7.0, hard=True)  # connection refused: the process is gone
    pool.record_worker(decode, True, 8.0)  # and answers again: a new process at the same address
    assert pool.pair_breakers.allows(pair, 8.0)
    assert pool.choose_pair("", 8.0) == pair


def test_pool_membership_changes() -> None:
    pool = _pool(1, 1)
    spec = pool.of_role(Role.DECODE)[0].spec
    pool.workers[spec.key].in_flight = 3
    pool.upsert(spec)  # same spec: state kept
    assert pool.workers[spec.key].in_flight == 3
    pool.upsert(WorkerSpec(Role.DECODE, spec.url, epoch=1))  # recreated group: fresh state
    assert pool.workers[spec.key].in_flight == 0
    pool.remove(spec.key)
    assert pool.choose_pair("", 0.0) is None


@pytest.mark.parametrize(("prefills", "decodes"), [(1, 1), (1, 2), (1, 4), (2, 2), (2, 3), (3, 2), (4, 2)])
def test_round_robin_pairs_walk_every_combination_evenly(prefills: int, decodes: int) -> None:
    """P * D successive requests use each (prefill, decode) pair once (one prefill and two decodes used to send
    every request to the same decode)."""
    pool = _pool(prefills, decodes)
    rounds = 3
    pairs: Counter[tuple[str, str]] = Counter()
    for _ in range(prefills * decodes * rounds):
        pair = pool.choose_pair("", 0.0)
        assert pair is not None
        pairs[pair.key] += 1
    assert len(pairs) == prefills * decodes
    assert set(pairs.values()) == {rounds}
