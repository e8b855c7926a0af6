"""Registry entries desired from pods, the etcd changes, epochs and fences on views (pure)."""

from __future__ import annotations

from dataclasses import replace

from tandem.registry import Endpoint, Role
from tandem_operator.decide.observe import GroupKey, GroupState, group_views
from tandem_operator.decide.recovery import (
    FenceRecord,
    apply_fences,
    fence_annotation,
    group_epochs,
    recovered,
    resumed_fences,
    service_epochs,
    service_fences,
    stamp_epoch,
)
from tandem_operator.decide.registration import (
    RegistryChanges,
    desired_endpoints,
    leader_endpoint,
    next_epoch,
    parse_group,
    registry_changes,
)
from tests.operator.conftest import kimi_spec
from tests.operator.workers import live_pod

SPEC = kimi_spec()  # rdma over mlx5_0/mlx5_1, decode groups of 2 nodes with attention DP 16
D0, D1, P0 = GroupKey(Role.DECODE, 0), GroupKey(Role.DECODE, 1), GroupKey(Role.PREFILL, 0)


def decode_group(index: int, epoch: int = 0, ready: bool = True, ip: str = "10.0.1.1") -> list[dict[str, object]]:
    return [
        live_pod(SPEC, Role.DECODE, index, 0, epoch=epoch, ip=ip, ready=ready),
        live_pod(SPEC, Role.DECODE, index, 1, epoch=epoch, ip="10.0.9.9", ready=ready),
    ]


def test_leader_endpoint_of_a_prefill_group() -> None:
    pod = live_pod(SPEC, Role.PREFILL, 0, 0, epoch=2, ip="10.0.0.7")
    endpoint = leader_endpoint(SPEC, Role.PREFILL, pod)
    assert endpoint == Endpoint(
        role=Role.PREFILL,
        group="prefill-0",
        url="http://10.0.0.7:30000",
        bootstrap_port=9000,  # epoch 2's port of the bootstrap range [8998, 9005]
        # rdma, 8 ranks: every engine's session id, in the pod's window of epoch 2 (the third of the range's eight)
        mooncake_sessions=tuple(f"10.0.0.7:{port}" for port in range(15016, 15024)),
        ib_devices=("mlx5_0", "mlx5_1"),
        attn_dp_size=1,
        model="kimi-k2.6",
        revision=pod["metadata"]["labels"]["tandem.dev/revision"],
        epoch=2,
    )


def test_leader_endpoint_of_a_one_gpu_rdma_pod_names_its_session() -> None:
    spec = kimi_spec(prefill={"tpSize": 1, "epSize": 1, "gpusPerNode": 1, "moeA2ABackend": "none"})
    endpoint = leader_endpoint(spec, Role.PREFILL, live_pod(spec, Role.PREFILL, 0, 0, ip="10.0.0.7"))
    assert endpoint is not None
    assert endpoint.mooncake_sessions == ("10.0.0.7:15000",)  # one rank, one port: the session id is exact


def test_leader_endpoint_of_a_decode_group_over_tcp() -> None:
    spec = kimi_spec(transfer={"protocol": "tcp"})
    members = [live_pod(spec, Role.DECODE, 3, rank, epoch=1, ip=f"10.2.0.{5 + rank}") for rank in (1, 0)]
    endpoint = leader_endpoint(spec, Role.DECODE, members[1], members)
    assert endpoint is not None
    assert (endpoint.group, endpoint.url, endpoint.bootstrap_port) == ("decode-3", "http://10.2.0.5:30001", None)
    assert (endpoint.ib_devices, endpoint.attn_dp_size) == ((), 16)
    # tcp, 8 ranks per pod with decode KV offload: each pod's window of epoch 1 (RPC and data ports of the PD and the
    # Store engines, any may be a session), rank by rank
    window = range(15132, 15164)
    assert endpoint.mooncake_sessions == tuple(f"10.2.0.{ip}:{port}" for ip in (5, 6) for port in window)


def test_no_endpoint_without_ip_or_for_a_follower() -> None:
    assert leader_endpoint(SPEC, Role.DECODE, live_pod(SPEC, Role.DECODE, 0, 0, ip=None)) is None
    assert leader_endpoint(SPEC, Role.DECODE, live_pod(SPEC, Role.DECODE, 0, 1)) is None


def test_only_ready_unfenced_groups_are_desired() -> None:
    pods = decode_group(0) + decode_group(1, ready=False, ip="10.0.1.2") + decode_group(2, epoch=4, ip="10.0.1.3")
    views = group_views(pods, 2)
    desired = desired_endpoints(SPEC, Role.DECODE, views, pods, fenced={GroupKey(Role.DECODE, 2): 3})
    assert sorted(desired) == [D0, GroupKey(Role.DECODE, 2)]  # group 2 was fenced at epoch 3, now runs epoch 4
    assert desired_endpoints(SPEC, Role.DECODE, views, pods, fenced={GroupKey(Role.DECODE, 2): 4}).keys() == {D0}
    assert desired_endpoints(SPEC, Role.PREFILL, views, pods, fenced={}) == {}


def test_registry_changes() -> None:
    a = leader_endpoint(SPEC, Role.DECODE, decode_group(0)[0])
    b = leader_endpoint(SPEC, Role.DECODE, decode_group(1, ip="10.0.1.2")[0])
    assert a is not None
    assert b is not None
    b2 = b.model_copy(update={"epoch": 1})
    assert registry_changes({D0: a, D1: b2}, {D0: a, D1: b}) == RegistryChanges(put={D1: b2}, remove={})
    assert registry_changes({}, {D0: a}) == RegistryChanges(put={}, remove={D0: a})
    assert parse_group(a) == D0
    assert parse_group(a.model_copy(update={"group": "something-else"})) is None


def test_epochs() -> None:
    assert next_epoch() == 0
    assert next_epoch(None, 2, 5) == 6
    pods = [*decode_group(0, epoch=3), live_pod(SPEC, Role.PREFILL, 0, 0, epoch=1)]
    assert group_epochs(pods) == {D0: 3, P0: 1}
    service = stamp_epoch({"metadata": {"labels": {"tandem.dev/role": "decode", "tandem.dev/group": "0"}}}, 7)
    assert service["metadata"]["annotations"] == {"tandem.dev/epoch": "7"}
    assert service_epochs([service, {"metadata": {"labels": {}}}]) == {D0: 7}


def test_a_fence_recorded_on_the_service_is_resumed_while_its_incarnation_has_pods() -> None:
    labels = {"tandem.dev/role": "decode", "tandem.dev/group": "0"}
    patch = fence_annotation(4, "pod-not-ready")
    assert patch == {"metadata": {"annotations": {"tandem.dev/fenced": "4/pod-not-ready"}}}
    service = {
        "metadata": {"labels": labels, "annotations": {"tandem.dev/epoch": "5", **patch["metadata"]["annotations"]}}
    }
    other = {"metadata": {"labels": {**labels, "tandem.dev/group": "1"}, "annotations": {"tandem.dev/fenced": "x/y"}}}
    recorded = service_fences([service, other])
    assert recorded == {D0: (4, "pod-not-ready")}
    assert resumed_fences(recorded, {}, {D0: 4}) == {D0: (4, "pod-not-ready")}  # the fenced pods are still there
    assert resumed_fences(recorded, {}, {D0: 5}) == {}  # already recreated
    assert resumed_fences(recorded, {}, {}) == {}  # no pods left: the group is simply created again
    assert resumed_fences(recorded, {D0: FenceRecord(4, "pod-not-ready", 0.0)}, {D0: 4}) == {}  # known already


def test_a_fenced_incarnation_is_broken_even_if_its_pods_look_ready() -> None:
    views = group_views(decode_group(0, epoch=2) + decode_group(1, epoch=0, ip="10.0.1.2"), 2)
    fenced = apply_fences(Role.DECODE, views, {D0: 2, D1: 5}, {D0: 2, D1: 0})
    assert fenced[0] == replace(views[0], state=GroupState.BROKEN)
    assert fenced[1] == views[1]  # fenced at another epoch: the new incarnation is judged on its own


def test_recovered_when_a_newer_epoch_is_registered() -> None:
    fenced = {D0: FenceRecord(2, "PodDeleted", 100.0), D1: FenceRecord(0, "PodFailed", 101.0)}
    assert recovered(fenced, {D0: 3, D1: 0}, now=104.5) == {D0: 4.5}
