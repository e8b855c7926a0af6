"""The registry removal-storm guard as a table of transitions (pure, no etcd): one removal at once, a storm held,
held workers released by failed checks or a settled registry, never by time alone while the registry is away."""

from __future__ import annotations

from hypothesis import given
from hypothesis import strategies as st

from tandem_router.registry_guard import GuardConfig, RegistryGuard, Verdict

FOUR = ("p0", "p1", "d0", "d1")


def guard(keys: tuple[str, ...] = FOUR, **config: float) -> RegistryGuard:
    g = RegistryGuard(GuardConfig(**config))  # type: ignore[arg-type]
    for key in keys:
        g.put(key)
    return g


def healthy(_key: str) -> bool:
    return True


def failing_none(_key: str) -> bool:
    return False


def test_one_removal_takes_effect_at_once() -> None:
    g = guard()
    assert g.removed(["d1"], 0.0, healthy) == Verdict(remove=("d1",))
    assert not g.panicking
    assert g.held == {}


def test_a_lease_expiry_storm_holds_every_worker_and_restores_the_first_removed() -> None:
    g = guard()
    assert g.removed(["p0"], 0.0, healthy) == Verdict(remove=("p0",))  # 1 of 4: not yet a storm
    assert g.removed(["p1"], 0.0, healthy) == Verdict(hold=("p1",), restore=("p0",))  # 2 of 4: a storm
    assert g.removed(["d0", "d1"], 0.0, healthy) == Verdict(hold=("d0", "d1"))
    assert g.panicking
    assert set(g.held) == set(FOUR)
    assert g.panics == 1


def test_an_unhealthy_worker_removed_before_the_storm_stays_out() -> None:
    g = guard()
    g.removed(["p0"], 0.0, healthy)
    assert g.removed(["p1"], 1.0, lambda key: key != "p0") == Verdict(hold=("p1",))


def test_workers_put_back_end_the_panic() -> None:
    g = guard()
    g.removed(list(FOUR), 0.0, healthy)
    for key in FOUR:
        g.put(key)
    assert not g.panicking
    assert g.held == {}
    assert g.tick(100.0, True, failing_none) == ()


def test_held_workers_that_fail_their_checks_leave_at_once() -> None:
    g = guard()
    g.removed(list(FOUR), 0.0, healthy)
    assert g.tick(0.5, False, lambda key: key == "d1") == ("d1",)  # even with the registry unreachable
    assert set(g.held) == {"p0", "p1", "d0"}
    assert g.released == 1


def test_held_workers_go_once_the_connected_registry_settles_without_them() -> None:
    g = guard(settle_s=30.0)
    g.removed(list(FOUR), 0.0, healthy)
    g.put("p0")
    g.put("d0")
    assert g.tick(29.9, True, failing_none) == ()
    assert g.tick(300.0, False, failing_none) == ()  # registry away: no settling, whatever the time
    assert set(g.tick(300.0, True, failing_none)) == {"p1", "d1"}
    assert not g.panicking
    assert g.registered == {"p0", "d0"}


def test_removals_outside_the_window_are_no_storm() -> None:
    g = guard(window_s=10.0)
    assert g.removed(["p0"], 0.0, healthy).remove == ("p0",)
    assert g.removed(["d0"], 10.5, healthy).remove == ("d0",)


def test_one_fence_in_a_one_by_one_cluster_is_no_storm() -> None:
    g = guard(("p0", "d0"))
    assert g.removed(["d0"], 0.0, healthy) == Verdict(remove=("d0",))


def test_a_key_put_back_within_the_window_no_longer_counts() -> None:
    g = guard()
    g.removed(["p0"], 0.0, healthy)
    g.put("p0")  # the next incarnation
    assert g.removed(["d0"], 1.0, healthy) == Verdict(remove=("d0",))


def test_unknown_keys_change_nothing() -> None:
    g = guard()
    assert g.removed(["nope"], 0.0, healthy) == Verdict()


@given(
    workers=st.integers(min_value=1, max_value=40),
    removed=st.integers(min_value=0, max_value=40),
    share=st.floats(min_value=0.05, max_value=1.0),
)
def test_a_batch_is_held_exactly_when_it_reaches_the_share_and_the_minimum(
    workers: int, removed: int, share: float
) -> None:
    keys = tuple(f"w{i}" for i in range(workers))
    g = guard(keys, panic_share=share, min_removals=2)
    gone = keys[: min(removed, workers)]
    verdict = g.removed(list(gone), 0.0, healthy)
    storm = len(gone) >= 2 and len(gone) >= share * workers
    assert set(verdict.hold) == (set(gone) if storm else set())
    assert set(verdict.remove) == (set() if storm else set(gone))
    assert g.registered == set(keys) - set(gone)
