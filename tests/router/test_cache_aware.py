"""Table tests of cache-aware prefill selection: the approximate prefix tree, the choice, the pool's bookkeeping."""

from __future__ import annotations

import pytest

from tandem.registry import Role
from tandem_router.openai.schema import Route, routing_key
from tandem_router.policy import cache_aware as ca
from tandem_router.policy import selection as sel
from tandem_router.policy.prefix_tree import PrefixTree, RoutingKey
from tandem_router.pool import WorkerPool, WorkerSpec

CFG = ca.CacheAwareConfig()
V = ca.PrefillView


@pytest.mark.parametrize(
    ("inserted", "key", "matched"),
    [
        ([], "abc", 0),
        (["abcdef"], "abcdef", 6),
        (["abcdef"], "abcxyz", 3),  # a partial edge counts
        (["abcdef"], "ab", 2),
        (["abcdef", "abcxyz"], "abcxy", 5),  # after the split
        (["abcdef", "abcxyz"], "abcdeq", 5),
        (["abc", "abcdef"], "abcdefg", 6),
        (["abcdef"], "xbcdef", 0),
        ([(1, 2, 3, 4)], (1, 2, 3, 9), 3),  # token ids
        ([(1, 2, 3, 4), "1234"], (1, 2, 3, 4, 5), 4),  # ids and text never share a path
        ([(1, 2, 3, 4), "1234"], "12", 2),
    ],
)
def test_prefix_tree_longest_match(inserted: list[RoutingKey], key: RoutingKey, matched: int) -> None:
    tree = PrefixTree(1000)
    for k in inserted:
        tree.insert(k)
    assert tree.match(key) == matched


def test_prefix_tree_counts_units_and_evicts_least_recently_used_leaves() -> None:
    tree = PrefixTree(35)
    tree.insert("system-" + "a" * 8)  # 15 units
    tree.insert("system-" + "b" * 8)  # shares "system-": 8 more
    assert tree.units == 23
    tree.match("system-" + "a" * 8)  # touches the a-branch: b is now the least recently used
    tree.insert("other-" + "c" * 9)  # 15 more: 38 > 35, evicts down to 31 (90%): the b-leaf is enough
    assert tree.units == 30
    assert tree.match("system-" + "a" * 8) == 15
    assert tree.match("system-" + "b" * 8) == 7  # its leaf went; the shared "system-" stayed
    assert tree.match("other-" + "c" * 9) == 15


def test_prefix_tree_stays_bounded_under_many_distinct_keys() -> None:
    tree = PrefixTree(500)
    for i in range(2000):
        tree.insert(tuple(range(i, i + 20)))
    assert tree.units <= 500
    assert tree.match(tuple(range(1999, 2019))) == 20  # the newest survive


@pytest.mark.parametrize(
    ("views", "key", "expected", "why"),
    [
        ([V(0, 0), V(0, 0)], "x" * 400, 0, "no match anywhere: the cheapest, lowest index on ties"),
        ([V(0, 0, 90), V(0, 0, 30)], "x" * 400, 1, "no match, equal work: the smaller tree (more cache room)"),
        ([V(0, 500), V(0, 0)], "x" * 400, 1, "no match: the least prefill work"),
        ([V(0, 0), V(300, 0)], "x" * 400, 1, "75% matched on 1: affinity"),
        ([V(0, 0), V(150, 100)], "x" * 400, 0, "37% matched (< cache_threshold 0.5): a miss, the cheapest"),
        ([V(0, 0), V(300, 3800)], "x" * 400, 1, "affinity holds while the extra work is < abs threshold"),
        ([V(0, 0), V(300, 5000)], "x" * 400, 0, "abs AND rel exceeded: the cheapest"),
        ([V(0, 50000), V(300, 54500)], "x" * 400, 1, "4.4k tokens more (> abs) but within 10% (rel): affinity"),
        ([V(0, 20000), V(300, 24500)], "x" * 400, 0, "4.4k tokens more (> abs) and 22% more (> rel): the cheapest"),
        ([V(300, 900), V(300, 0)], "x" * 400, 1, "equal matches: the lower load"),
        ([V(380, 0), V(300, 0), V(0, 0)], "x" * 400, 0, "the longest match"),
        ([V(3, 0), V(0, 0)], (1, 2, 3, 4), 0, "token ids: 3 of 4 matched"),
        ([V(0, 3), V(0, 0)], "", 1, "an empty key: the least loaded"),
    ],
)
def test_choose_prefill(views: list[ca.PrefillView], key: RoutingKey, expected: int, why: str) -> None:
    assert ca.choose_prefill(views, key, CFG) == expected, why


@pytest.mark.parametrize(("key", "tokens"), [("", 0), ("abcd", 1), ("abcde", 2), ((1, 2, 3), 3)])
def test_key_tokens(key: RoutingKey, tokens: int) -> None:
    assert ca.key_tokens(key) == tokens


@pytest.mark.parametrize(
    ("route", "body", "key"),
    [
        (Route.GENERATE, {"input_ids": [5, 6, 7]}, (5, 6)),
        (Route.GENERATE, {"input_ids": [[5, 6, 7], [8]]}, (5, 6)),
        (Route.GENERATE, {"text": "hello"}, "he"),
        (Route.COMPLETIONS, {"prompt": [9, 8, 7]}, (9, 8)),
        (Route.COMPLETIONS, {"prompt": "hello"}, "he"),
        (Route.CHAT, {"messages": [{"role": "user", "content": "hello"}]}, "he"),
    ],
)
def test_routing_key_prefers_token_ids(route: Route, body: dict[str, object], key: RoutingKey) -> None:
    assert routing_key(route, body, "hello", 2) == key


def _pool(prefills: int) -> WorkerPool:
    pool = WorkerPool(sel.Policy.CACHE_AWARE)
    pool.replace_all(
        [WorkerSpec(Role.PREFILL, f"http://p{i}:1", 8998) for i in range(prefills)]
        + [WorkerSpec(Role.DECODE, "http://d0:1")]
    )
    return pool


def test_pool_keeps_a_conversation_on_its_prefill_and_spreads_new_ones() -> None:
    pool = _pool(4)
    system = "You are a terse assistant. " * 20  # 540 characters every conversation shares
    firsts = []
    for user in range(8):
        history = system + f"user {user} pastes a long document: " + f"line {user} of the document. " * 80
        pair = pool.choose_pair(history, 0.0)
        assert pair is not None
        pool.dispatched(pair, 0.0)  # all in flight at once: the work is spread
        firsts.append(pair.prefill.key)
        for turn in range(3):
            history += f"answer {turn}. follow-up question {turn} of user {user}. "
            again = pool.choose_pair(history, 0.0)
            assert again is not None
            assert again.prefill.key == pair.prefill.key
            assert again.prefill_tokens < 20  # only the new turn is expected to be uncached
    assert len(set(firsts)) == 4


def test_pool_shared_system_prompt_sticks_until_the_work_spread_exceeds_the_threshold() -> None:
    pool = _pool(2)
    system = "You are a terse assistant. " * 40  # 1080 characters: most of each short first turn
    chosen = []
    for user in range(300):
        pair = pool.choose_pair(system + f"I am user {user}. " * 6, 0.0)  # about 25 new tokens each
        assert pair is not None
        pool.dispatched(pair, 0.0)
        chosen.append(pair.prefill.key)
    first = chosen[0]
    # Affinity holds while the extra work on the first prefill stays within balance_abs_threshold (4096 tokens)...
    assert chosen[:20] == [first] * 20
    # ...then the other takes new conversations too, and both stay within the threshold of each other.
    assert len(set(chosen)) == 2
    loads = [w.prefill_tokens for w in pool.of_role(Role.PREFILL)]
    assert max(loads) - min(loads) <= ca.CacheAwareConfig().balance_abs_threshold + 300


def test_pool_prefill_load_is_tokens_in_flight_and_rebalances() -> None:
    pool = _pool(2)
    conversation = "z" * 8000  # 2000 tokens
    pair = pool.choose_pair(conversation, 0.0)
    assert pair is not None
    assert pair.prefill_tokens == 2000
    pool.dispatched(pair, 0.0)
    home = pool.workers[pair.prefill.key]
    assert home.prefill_tokens == 2000
    pool.prefilled(pair)
    assert home.prefill_tokens == 0
    conversation += " next turn"
    follow = pool.choose_pair(conversation, 0.0)
    assert follow is not None
    assert follow.prefill.key == pair.prefill.key
    assert follow.prefill_tokens == 3
    home.prefill_tokens = 10_000  # other conversations' work queued there: 8k tokens more than computing it all
    conversation += " and another"
    moved = pool.choose_pair(conversation, 0.0)
    assert moved is not None
    assert moved.prefill.key != pair.prefill.key
    assert moved.prefill_tokens == ca.key_tokens(conversation)


def test_pool_forgets_a_prefills_cache_when_it_leaves_or_restarts() -> None:
    pool = _pool(2)
    pair = pool.choose_pair("some prompt " * 50, 0.0)
    assert pair is not None
    assert pair.prefill.key in pool.trees
    pool.upsert(WorkerSpec(Role.PREFILL, pair.prefill.url, 8998, epoch=1))  # recreated: an empty cache
    assert pair.prefill.key not in pool.trees
    pool.choose_pair("some prompt " * 50, 0.0)
    pool.remove(pair.prefill.key)
    assert pair.prefill.key not in pool.trees


def test_other_policies_keep_no_trees() -> None:
    pool = WorkerPool(sel.Policy.ROUND_ROBIN)
    pool.replace_all([WorkerSpec(Role.PREFILL, "http://p:1", 8998), WorkerSpec(Role.DECODE, "http://d:1")])
    assert pool.choose_pair("abc", 0.0) is not None
    assert pool.trees == {}


@pytest.mark.parametrize(("in_flight", "rank"), [([0], 0), ([3, 1, 2], 1), ([2, 2], 0), ([5, 0, 0, 1], 1)])
def test_least_loaded_rank(in_flight: list[int], rank: int) -> None:
    assert sel.least_loaded_rank(in_flight) == rank


def test_pool_spreads_a_dp_attention_decodes_requests_over_its_ranks() -> None:
    pool = WorkerPool(sel.Policy.CACHE_AWARE)
    decode = WorkerSpec(Role.DECODE, "http://d:1", attn_dp_size=4)
    pool.replace_all([WorkerSpec(Role.PREFILL, "http://p:1", 8998), decode])
    pairs = []
    for i in range(6):
        pair = pool.choose_pair(f"{i}: a prompt", 0.0)
        assert pair is not None
        pool.dispatched(pair, 0.0)
        pairs.append(pair)
    assert [p.decode_dp_rank for p in pairs] == [0, 1, 2, 3, 0, 1]
    pool.finished(pairs[2])  # rank 2 has the fewest now
    nxt = pool.choose_pair("another prompt", 0.0)
    assert nxt is not None
    assert nxt.decode_dp_rank == 2
    plain = WorkerPool(sel.Policy.CACHE_AWARE)
    plain.replace_all([WorkerSpec(Role.PREFILL, "http://p:1", 8998), WorkerSpec(Role.DECODE, "http://d:1")])
    one = plain.choose_pair("x", 0.0)
    assert one is not None
    assert one.decode_dp_rank is None  # no attention DP: the field is not sent
