"""How much mirrored load a pair on probation gets (no I/O: pool and monitor state only)."""

from __future__ import annotations

from prometheus_client import CollectorRegistry

from tandem.registry import Role
from tandem_router.integrity.monitor import IntegrityConfig, IntegrityMonitor
from tandem_router.integrity.quarantine import QuarantinePolicy
from tandem_router.pool import WorkerPool, WorkerSpec
from tandem_router.probation import load_target, mirror_targets

P = [WorkerSpec(Role.PREFILL, f"http://p{i}:1", 8998) for i in range(2)]
D = [WorkerSpec(Role.DECODE, f"http://d{i}:2") for i in range(2)]


def _pool_with_bad_decode(on_probation: int) -> tuple[WorkerPool, IntegrityMonitor]:
    """48 client requests in flight on d0; d1's pairs quarantined, ``on_probation`` of them on probation."""
    monitor = IntegrityMonitor(IntegrityConfig(policy=QuarantinePolicy(threshold=1)), CollectorRegistry())
    pool = WorkerPool(gates=[monitor])
    for spec in (*P, *D):
        pool.upsert(spec)
    pool.workers[D[0].key].in_flight = 48
    bad = [(p.key, D[1].key) for p in P]
    monitor.set_pairs([(p.key, d.key) for p in P for d in D])
    for pair in bad:
        monitor.failure(pair, "canary")
    monitor.book.start_probations(float("inf"))  # both pairs of d1 on probation
    for pair in bad[on_probation:]:
        monitor.book.record_comparison(pair, False, float("inf"), "mismatch")  # back to quarantine
    return pool, monitor


def test_a_decode_on_probation_carries_what_a_serving_decode_carries() -> None:
    pool, monitor = _pool_with_bad_decode(on_probation=2)
    targets = mirror_targets(pool, monitor, set(monitor.probation_pairs()))
    assert sorted(targets.values()) == [24, 24]  # 48 on d1 in all, like d0
    pool, monitor = _pool_with_bad_decode(on_probation=1)
    [(pair, target)] = mirror_targets(pool, monitor, set(monitor.probation_pairs())).items()
    assert target == 48  # its other pair is back in quarantine: this one carries the decode's whole share
    assert load_target(pool, monitor, pair) == 48
    assert load_target(pool, monitor, (P[0].key, D[0].key)) == 24  # a serving pair's share
