"""Peer weight loading (issue #35, ``spec.peerLoading``): which seed a created group pulls its weights from, the
flags that say so, and what never counts as a change of the pods' revision. Pure, plus the executor with a fake
Kube (tests/operator/fakes.py)."""

from __future__ import annotations

import asyncio
from typing import Any

import pytest
from pydantic import ValidationError

from tandem.registry import Endpoint, Role
from tandem.sglang_args import validate_command
from tandem_operator.act.executor import Executor
from tandem_operator.api.pdcluster import PDClusterSpec
from tandem_operator.decide.fencing import Fence, FenceReason
from tandem_operator.decide.observe import GroupKey, GroupState, GroupView
from tandem_operator.decide.planner import (
    CreateGroup,
    CreatePods,
    DeleteGroup,
    DeleteReason,
    Observed,
    seed_pool,
    steps,
)
from tandem_operator.decide.recovery import service_peer_load_failures, stamp_epoch
from tandem_operator.desired.args import LAUNCH
from tandem_operator.desired.compare import drift
from tandem_operator.desired.naming import (
    ANNOTATION_PEER_LOAD_FAILED,
    ANNOTATION_WEIGHT_SEED,
    ANNOTATION_WEIGHT_SOURCE,
    LABEL_TEMPLATE_HASH,
)
from tandem_operator.desired.pods import RoleContext, group_pod, mooncake_port_range
from tandem_operator.desired.seeding import (
    PEER_FLAGS,
    SEED_FLAG,
    Seed,
    choose_seed,
    died_loading_from_peer,
)
from tests.operator.conftest import kimi_spec
from tests.operator.fakes import FakeKube, FakeRegistrar
from tests.operator.workers import CLUSTER, POOL

SPEC = kimi_spec(peerLoading={"enabled": True})
CTX = RoleContext.build(CLUSTER, SPEC, Role.DECODE, POOL)
NODES = SPEC.decode.nodes_per_group
PORT = SPEC.decode.ports.http
R, S, B = GroupState.READY, GroupState.STARTING, GroupState.BROKEN


def flag(args: list[str], name: str) -> str | None:
    return args[args.index(name) + 1] if name in args else None


def pod(index: int, rank: int, *, epoch: int = 0, seed: Seed | None = None, ip: str = "10.0.0.1") -> dict[str, Any]:
    made = stamp_epoch(group_pod(CTX, index, rank, epoch, seed), epoch)
    made["spec"]["nodeName"] = f"gpu-{index}-{rank}"
    made["status"] = {"phase": "Running", "podIP": ip, "conditions": [{"type": "Ready", "status": "True"}]}
    return made


def world(*groups: tuple[int, GroupState, Seed | None]) -> tuple[dict[int, GroupView], dict[str, dict[str, Any]]]:
    """Groups (index, state, the seed they loaded from) of CTX's template, leader IP 10.0.<index>.1."""
    views, pods = {}, {}
    for index, state, seed in groups:
        members = [pod(index, rank, seed=seed, ip=f"10.0.{index}.{rank + 1}") for rank in range(NODES)]
        pods.update({p["metadata"]["name"]: p for p in members})
        views[index] = GroupView(index, state, CTX.template_hash, tuple(sorted(p["metadata"]["name"] for p in members)))
    return views, pods


def seed_of(index: int, epoch: int = 0) -> Seed:
    return Seed(index, f"kimi-decode-{index}", epoch, f"10.0.{index}.1", PORT)


def created_args(step: Any) -> list[list[str]]:
    assert isinstance(step, CreatePods)
    return [m["spec"]["containers"][0]["args"] for m in step.manifests if m["kind"] == "Pod"]


# -- rendering ----------------------------------------------------------------------------------------------------
def test_every_pod_starts_as_a_seed_and_a_peer_gets_the_remote_instance_flags() -> None:
    plain = group_pod(CTX, 1, 0)["spec"]["containers"][0]["args"]
    assert SEED_FLAG in plain
    assert "--load-format" not in plain
    peer = group_pod(CTX, 1, 1, 3, seed_of(0))["spec"]["containers"][0]["args"]
    assert flag(peer, "--load-format") == "remote_instance"
    assert flag(peer, "--remote-instance-weight-loader-backend") == "transfer_engine"
    assert flag(peer, "--remote-instance-weight-loader-seed-instance-ip") == "10.0.0.1"
    assert flag(peer, "--remote-instance-weight-loader-seed-instance-service-port") == str(PORT)
    assert SEED_FLAG in peer


@pytest.mark.parametrize("seed", [None, Seed(0, "kimi-decode-0", 0, "10.0.0.1", 30001)])
@pytest.mark.parametrize("role", list(Role))
def test_the_command_lines_parse_with_sglang_flags(role: Role, seed: Seed | None) -> None:
    ctx = RoleContext.build(CLUSTER, SPEC, role, POOL)
    command = group_pod(ctx, 1, 0, 0, seed)["spec"]["containers"][0]["args"]
    assert tuple(command[: len(LAUNCH)]) == LAUNCH
    assert validate_command(command[len(LAUNCH) :]) == []


def test_a_one_node_seed_names_its_own_address_so_its_ranks_reach_the_bootstrap() -> None:
    """SGLang 0.5.23 binds the engine-info bootstrap on --host (the pod IP) and its one-node ranks PUT to 127.0.0.1
    unless --dist-init-addr names the head: a one-node seed gets its group's own address."""
    one = {"groups": 1, "nodesPerGroup": 1, "gpusPerNode": 8, "tpSize": 8, "epSize": 8}
    for enabled, expected in ((True, "kimi-prefill-1.serving.svc:5000"), (False, None)):
        spec = kimi_spec(prefill=one, peerLoading={"enabled": enabled})
        ctx = RoleContext.build(CLUSTER, spec, Role.PREFILL, POOL)
        args = group_pod(ctx, 1, 0)["spec"]["containers"][0]["args"]
        assert flag(args, "--dist-init-addr") == expected
        assert "--nnodes" not in args
        assert validate_command(args[len(LAUNCH) :]) == []


def test_without_peer_loading_nothing_changes() -> None:
    plain = kimi_spec()
    ctx = RoleContext.build(CLUSTER, plain, Role.DECODE, POOL)
    rendered = group_pod(ctx, 1, 0)
    assert SEED_FLAG not in rendered["spec"]["containers"][0]["args"]
    assert ANNOTATION_WEIGHT_SOURCE not in rendered["metadata"].get("annotations", {})
    assert "peerLoading" not in plain.model_dump(by_alias=True, exclude_defaults=True)


def test_the_seed_is_no_part_of_the_revision() -> None:
    """Pods of one template, from the node or from any seed, carry the same template hash and no drift."""
    from_node, from_peer = group_pod(CTX, 1, 0, 2), group_pod(CTX, 1, 0, 2, seed_of(0))
    assert from_node["metadata"]["labels"][LABEL_TEMPLATE_HASH] == from_peer["metadata"]["labels"][LABEL_TEMPLATE_HASH]
    assert from_peer["metadata"]["annotations"][ANNOTATION_WEIGHT_SOURCE] == "peer"
    assert from_peer["metadata"]["annotations"][ANNOTATION_WEIGHT_SEED] == "kimi-decode-0/0"
    assert from_node["metadata"]["annotations"][ANNOTATION_WEIGHT_SOURCE] == "node"
    assert drift(from_peer, from_node) == []
    assert drift(from_node, from_peer) == []


def test_enabling_it_rolls_the_pods() -> None:
    """The seed flag and the wider Mooncake window are the template's: turning peer loading on is a spec change."""
    plain = RoleContext.build(CLUSTER, kimi_spec(), Role.DECODE, POOL)
    assert plain.template_hash != CTX.template_hash
    low, high = mooncake_port_range(CTX)
    plain_low, plain_high = mooncake_port_range(plain)
    assert (low, high - low + 1) == (plain_low, 2 * (plain_high - plain_low + 1))  # a weight engine per rank


def test_the_window_must_hold_the_weight_engines() -> None:
    fits = {"protocol": "tcp"}
    kimi_spec(transfer=fits, peerLoading={"enabled": True})  # 8 ranks x 2 ports x (PD + Store + weights) = 48 <= 64
    small = {**SPEC.decode.model_dump(by_alias=True, exclude_defaults=True)}
    small["ports"] = {**SPEC.decode.ports.to_wire(), "mooncakePorts": 40}
    with pytest.raises(ValidationError, match=r"one more with peerLoading\.enabled"):
        kimi_spec(transfer=fits, decode=small, peerLoading={"enabled": True})
    kimi_spec(transfer=fits, decode=small)


def test_extra_args_may_not_set_the_load_flags() -> None:
    for extra in ("--load-format=dummy", SEED_FLAG, "--remote-instance-weight-loader-seed-instance-ip"):
        with pytest.raises(ValidationError, match="extraArgs may not set flags the operator manages"):
            kimi_spec(prefill={"extraArgs": [extra]})


def test_max_loads_per_seed_has_a_sane_default_and_bounds() -> None:
    assert SPEC.peer_loading.max_loads_per_seed == 2
    with pytest.raises(ValidationError):
        kimi_spec(peerLoading={"enabled": True, "maxLoadsPerSeed": 0})


# -- the decision -------------------------------------------------------------------------------------------------
def test_choose_seed_takes_the_least_loaded_under_the_limit() -> None:
    a, b = seed_of(0), seed_of(1)
    assert choose_seed([a, b], {}, 2) == a
    assert choose_seed([a, b], {a.ref: 1}, 2) == b
    assert choose_seed([a, b], {a.ref: 2, b.ref: 1}, 2) == b
    assert choose_seed([a, b], {a.ref: 2, b.ref: 2}, 2) is None
    assert choose_seed([], {}, 2) is None


def test_seed_pool_takes_serving_ready_current_groups_that_read_from_the_node() -> None:
    views, pods = world((0, R, None), (1, R, seed_of(0)), (2, S, seed_of(0)), (3, R, None), (4, R, None), (5, B, None))
    views[4] = GroupView(4, R, "outdated", views[4].pods)
    pool = seed_pool(CTX, views, pods, serving=frozenset({0, 1, 2, 4, 5}))
    assert pool is not None
    # 1 loaded from a peer (it publishes nothing), 2 is loading, 3 is not serving (draining, fenced, quarantined...),
    # 4 has another template, 5 is broken
    assert [s.index for s in pool.candidates] == [0]
    assert pool.candidates[0] == seed_of(0)
    assert pool.loading == {"kimi-decode-0/0": 1}
    assert pool.limit == 2
    assert seed_pool(RoleContext.build(CLUSTER, kimi_spec(), Role.DECODE, POOL), views, pods, frozenset({0})) is None


def test_a_recreated_group_loads_from_a_seed_with_the_same_template_hash() -> None:
    views, pods = world((0, R, None))
    seen = Observed(
        pods, {GroupKey(Role.DECODE, 1): 3}, {}, frozenset(), seeds=seed_pool(CTX, views, pods, frozenset({0}))
    )
    (step,) = steps(CTX, [CreateGroup(1)], views, seen)
    args = created_args(step)
    assert len(args) == NODES  # every rank pulls its shard from the seed's same rank, via the seed's leader
    assert {flag(a, "--remote-instance-weight-loader-seed-instance-ip") for a in args} == {"10.0.0.1"}
    assert isinstance(step, CreatePods)
    hashes = {m["metadata"]["labels"][LABEL_TEMPLATE_HASH] for m in step.manifests if m["kind"] == "Pod"}
    assert hashes == {CTX.template_hash}


def test_at_most_max_loads_per_seed_then_the_node() -> None:
    views, pods = world((0, R, None), (1, S, seed_of(0)))
    seen = Observed(pods, {}, {}, frozenset(), seeds=seed_pool(CTX, views, pods, frozenset({0})))
    first, second = steps(CTX, [CreateGroup(2), CreateGroup(3)], views, seen)
    assert flag(created_args(first)[0], "--load-format") == "remote_instance"  # 2 loads: 1 and 2
    assert "--load-format" not in created_args(second)[0]  # 0 is full: from the node


def test_no_seed_no_peer_flags() -> None:
    views, pods = world((0, S, None))
    seen = Observed(pods, {}, {}, frozenset(), seeds=seed_pool(CTX, views, pods, frozenset({0})))
    (step,) = steps(CTX, [CreateGroup(1)], views, seen)
    assert "--load-format" not in created_args(step)[0]


def test_a_group_deleted_in_the_same_pass_seeds_nothing() -> None:
    views, pods = world((0, R, None), (1, B, None))
    seen = Observed(pods, {}, {}, frozenset(), seeds=seed_pool(CTX, views, pods, frozenset({0})))
    _, step = steps(CTX, [DeleteGroup(0, DeleteReason.SCALE_DOWN), CreateGroup(2)], views, seen)
    assert "--load-format" not in created_args(step)[0]


def test_missing_ranks_of_a_group_are_added_from_the_node() -> None:
    views, pods = world((0, R, None))
    name = f"{CTX.cluster.name}-decode-1-0"
    pods[name] = pod(1, 0)
    views[1] = GroupView(1, GroupState.INCOMPLETE, CTX.template_hash, (name,))
    seen = Observed(
        pods, {}, {GroupKey(Role.DECODE, 1): 0}, frozenset(), seeds=seed_pool(CTX, views, pods, frozenset({0}))
    )
    (step,) = steps(CTX, [CreateGroup(1)], views, seen)
    assert ["--load-format" in a for a in created_args(step)] == [False] * (NODES - 1)


def test_after_a_failed_peer_load_the_next_incarnation_reads_the_node() -> None:
    views, pods = world((0, R, None))
    key = GroupKey(Role.DECODE, 1)
    seeds = seed_pool(CTX, views, pods, frozenset({0}))
    failed = Observed(pods, {key: 4}, {}, frozenset({key}), seeds=seeds, peer_load_failed={key: 3})
    assert "--load-format" not in created_args(steps(CTX, [CreateGroup(1)], views, failed)[0])[0]
    # the incarnation after that one (which read the node) may use a peer again
    later = Observed(pods, {key: 5}, {}, frozenset({key}), seeds=seeds, peer_load_failed={key: 3})
    assert "--load-format" in created_args(steps(CTX, [CreateGroup(1)], views, later)[0])[0]


def test_died_loading_from_peer() -> None:
    peer, node = pod(1, 0, seed=seed_of(0)), pod(1, 0)
    assert died_loading_from_peer([peer], registered=False)
    assert not died_loading_from_peer([peer], registered=True)  # it had loaded and served: an ordinary death
    assert not died_loading_from_peer([node], registered=False)
    assert not died_loading_from_peer([], registered=False)


async def test_the_executor_records_a_failed_peer_load_in_memory_and_on_the_service() -> None:
    from tandem_operator.decide.state import ClusterState

    kube = FakeKube()
    state = ClusterState(CLUSTER, SPEC)
    executor = Executor(state, kube, FakeRegistrar(), "test")
    key = GroupKey(Role.DECODE, 1)
    members = [pod(1, rank, epoch=3, seed=seed_of(0)) for rank in range(NODES)]
    state.pods = {p["metadata"]["name"]: p for p in members}
    await executor.fence(Fence(key, 3, FenceReason.POD_FAILED, members[0]["metadata"]["name"]), 0.0)
    for _ in range(5):
        await asyncio.sleep(0)  # the Service patch runs in the background
    assert state.peer_load_failed == {key: 3}
    (patch,) = [c for c in kube.verbs("patch") if c[1].endswith("/services/kimi-decode-1")]
    labels = {"tandem.dev/role": "decode", "tandem.dev/group": "1"}
    service = {"metadata": {"labels": labels, **patch[2]["metadata"]}}
    assert service["metadata"]["annotations"][ANNOTATION_PEER_LOAD_FAILED] == "3"
    assert service_peer_load_failures([service]) == {key: 3}

    # a registered (served) group that dies is no failed load
    state.peer_load_failed.clear()
    state.registered[key] = Endpoint(
        role=Role.DECODE, group="decode-1", url="http://10.0.1.1:30001", epoch=3, model="kimi"
    )
    await executor.fence(Fence(key, 4, FenceReason.POD_FAILED, members[0]["metadata"]["name"]), 0.0)
    assert state.peer_load_failed == {}


def test_peer_flags_are_the_ones_peers_get() -> None:
    peer = group_pod(CTX, 1, 0, 0, seed_of(0))["spec"]["containers"][0]["args"]
    assert all(f in peer for f in PEER_FLAGS)
    assert isinstance(SPEC, PDClusterSpec)
