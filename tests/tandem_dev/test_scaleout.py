"""Which weight source the operator's own seed choice gives each new group, and when it serves
(``tandem_dev.scaleout``, issue #35): at most ``maxLoadsPerSeed`` loads per seed, a group that loaded from a peer
never seeds, a group still starting is no seed."""

from __future__ import annotations

from tandem.registry import Role
from tandem_dev.scaleout import Fleet, StartTimes, modelled_times, recipe_spec, scale_out
from tandem_sim.model.profiles import KIMI_LOAD

TIMES = StartTimes(node_s=100.0, peer_s=50.0)


def test_decode_1_to_4_two_from_the_seed_then_the_node() -> None:
    made = scale_out(TIMES, peer_loading=True)
    assert [(g.index, g.seed, g.ready_at) for g in made] == [(1, 0, 50.0), (2, 0, 50.0), (3, None, 100.0)]
    assert {(g.seed, g.ready_at) for g in scale_out(TIMES, peer_loading=False)} == {(None, 100.0)}


def test_a_group_that_loaded_from_a_peer_never_seeds() -> None:
    fleet = Fleet.build(recipe_spec(True), Role.DECODE, TIMES, serving=1)
    fleet.resize(0.0, 3)
    assert fleet.ready(49.0) == 1
    assert fleet.ready(50.0) == 3
    # at 1000 s the loads are done: decode-0 takes two more; decode-1 and -2 pulled theirs, so the next reads the node
    assert [g.seed for g in fleet.resize(1000.0, 6)] == [0, 0, None]


def test_a_starting_group_is_no_seed_and_loads_in_flight_count_across_passes() -> None:
    fleet = Fleet.build(recipe_spec(True), Role.PREFILL, TIMES, serving=1)
    assert [g.seed for g in fleet.resize(0.0, 2)] == [0]
    assert [g.seed for g in fleet.resize(15.0, 3)] == [0]  # one load in flight: under the limit of 2
    assert [g.seed for g in fleet.resize(30.0, 4)] == [None]  # two in flight
    assert fleet.resize(45.0, 2) == []  # the newest go first
    assert [g.index for g in fleet.groups] == [0, 1]


def test_modelled_start_times_per_role() -> None:
    spec = recipe_spec(True)
    decode, prefill = modelled_times(spec, Role.DECODE), modelled_times(spec, Role.PREFILL)
    assert decode.peer_s <= 90 < decode.node_s  # issue #35's goal, from a peer only
    assert decode.node_s - prefill.node_s == decode.peer_s - prefill.peer_s == KIMI_LOAD.cuda_graph_s
