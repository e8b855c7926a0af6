"""``WorkerPool.lease``: a dispatch counts in flight until released (once), and carries its outcome to the
worker and pair breakers; a client that left gives no verdict."""

from __future__ import annotations

from tandem.registry import Role
from tandem_router.policy.breaker import BreakerConfig, BreakerState
from tandem_router.pool import Pair, WorkerPool, WorkerSpec

P = WorkerSpec(Role.PREFILL, "http://p:1")
D = WorkerSpec(Role.DECODE, "http://d:1")
PAIR = Pair(P, D)


def _pool() -> WorkerPool:
    pool = WorkerPool(breaker_cfg=BreakerConfig(threshold=2, cooldown=60))
    pool.replace_all([P, D])
    return pool


def test_a_lease_is_in_flight_until_released_once() -> None:
    pool = _pool()
    lease = pool.lease(PAIR, 0.0)
    assert (pool.workers[P.key].in_flight, pool.workers[D.key].in_flight) == (1, 1)
    lease.release(1.0, ok=False)
    lease.release(1.0, ok=False)  # a second release neither counts nor scores
    assert (pool.workers[P.key].in_flight, pool.workers[D.key].in_flight) == (0, 0)
    assert pool.workers[D.key].breaker.failures == 1
    assert pool.pair_breakers.breakers[PAIR.key].failures == 1


def test_no_verdict_when_the_client_left_and_a_hard_failure_opens_the_worker_at_once() -> None:
    pool = _pool()
    pool.lease(PAIR, 0.0).release(1.0, ok=None)
    assert pool.workers[D.key].breaker.failures == 0
    assert PAIR.key not in pool.pair_breakers.breakers
    lease = pool.lease(PAIR, 2.0)
    lease.failed(Role.PREFILL, 2.0, hard=True)
    lease.release(2.0)
    assert pool.workers[P.key].breaker.state is BreakerState.OPEN
    assert pool.workers[D.key].breaker.state is BreakerState.CLOSED


def test_the_prefill_token_load_is_taken_off_once_whether_or_not_prefilled_was_said() -> None:
    pool = _pool()
    heavy = Pair(P, D, prefill_tokens=100)
    first, second = pool.lease(heavy, 0.0), pool.lease(heavy, 0.0)
    assert pool.workers[P.key].prefill_tokens == 200
    first.prefilled()
    first.prefilled()
    assert pool.workers[P.key].prefill_tokens == 100
    first.release(1.0, ok=True)
    second.release(1.0, ok=True)  # never said prefilled: released all the same
    assert pool.workers[P.key].prefill_tokens == 0
