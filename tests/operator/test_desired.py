"""Desired state as data: pods, args, env, volumes and placement of a group (golden) plus focused checks."""

from __future__ import annotations

import os
from pathlib import Path
from typing import Any

import pytest
import yaml

from tandem.registry import Role
from tandem_operator.api.pdcluster import PDClusterSpec
from tandem_operator.desired.naming import ClusterRef, OwnerRef, compat_revision, template_hash
from tandem_operator.desired.pods import RoleContext, group_manifests
from tandem_operator.desired.pools import pool_manifests

from .conftest import kimi_spec

GOLDEN = Path(__file__).parent / "golden"
CLUSTER = ClusterRef(name="kimi", namespace="llm", uid="11111111-2222-3333-4444-555555555555")


def ctx(spec: PDClusterSpec, role: Role) -> RoleContext:
    owner = OwnerRef("tandem.dev/v1alpha1", "PDPool", f"kimi-{role.value}", f"uid-{role.value}")
    return RoleContext.build(CLUSTER, spec, role, owner)


def check_golden(name: str, data: Any) -> None:
    """Compare with tests/operator/golden/<name>.yaml; TANDEM_UPDATE_GOLDEN=1 rewrites it (review the diff)."""
    path = GOLDEN / f"{name}.yaml"
    text = yaml.safe_dump(data, sort_keys=False, width=120)
    if os.environ.get("TANDEM_UPDATE_GOLDEN") == "1":
        path.write_text(text)
    assert path.read_text() == text, f"{path} differs; rerun with TANDEM_UPDATE_GOLDEN=1 and review"


def test_decode_group_golden() -> None:
    check_golden("decode-group-0", group_manifests(ctx(kimi_spec(), Role.DECODE), 0))


def test_prefill_group_golden() -> None:
    check_golden("prefill-group-1", group_manifests(ctx(kimi_spec(), Role.PREFILL), 1))


def container(pod: dict[str, Any]) -> dict[str, Any]:
    (only,) = pod["spec"]["containers"]
    assert isinstance(only, dict)
    return only


def flag(command: list[str], name: str) -> str | None:
    return command[command.index(name) + 1] if name in command else None


def test_multi_node_group_ranks_and_leader_address() -> None:
    service, *pods = group_manifests(ctx(kimi_spec(), Role.DECODE), 3)
    assert service["metadata"]["name"] == "kimi-decode-3"
    assert service["spec"]["selector"]["tandem.dev/rank"] == "0"
    assert service["spec"]["publishNotReadyAddresses"] is True
    assert [p["metadata"]["name"] for p in pods] == ["kimi-decode-3-0", "kimi-decode-3-1"]
    for rank, pod in enumerate(pods):
        command = container(pod)["command"]
        assert flag(command, "--dist-init-addr") == "kimi-decode-3.llm.svc:5001"
        assert (flag(command, "--nnodes"), flag(command, "--node-rank")) == ("2", str(rank))
        assert pod["metadata"]["labels"]["tandem.dev/rank"] == str(rank)


def test_only_prefill_leaders_carry_the_bootstrap_annotation() -> None:
    spec = kimi_spec(prefill={"nodesPerGroup": 2, "tpSize": 16, "epSize": 16})
    _, leader, follower = group_manifests(ctx(spec, Role.PREFILL), 0)
    assert leader["metadata"]["annotations"] == {"sglang.ai/bootstrap-port": "8998"}
    assert "annotations" not in follower["metadata"]
    for pod in (leader, follower):
        assert flag(container(pod)["command"], "--disaggregation-bootstrap-port") == "8998"
    _, decode_leader, _ = group_manifests(ctx(kimi_spec(), Role.DECODE), 0)
    assert "annotations" not in decode_leader["metadata"]
    assert "--disaggregation-bootstrap-port" not in container(decode_leader)["command"]


def test_single_node_group_has_no_dist_init() -> None:
    _, pod = group_manifests(ctx(kimi_spec(), Role.PREFILL), 0)
    command = container(pod)["command"]
    assert "--dist-init-addr" not in command
    assert "--nnodes" not in command


def test_tcp_transfer_has_no_infiniband_and_forces_tcp() -> None:
    spec = kimi_spec(transfer={"protocol": "tcp"})
    _, pod = group_manifests(ctx(spec, Role.PREFILL), 0)
    c = container(pod)
    assert "--disaggregation-ib-device" not in c["command"]
    assert {"name": "MC_FORCE_TCP", "value": "true"} in c["env"]
    assert [v["name"] for v in pod["spec"]["volumes"]] == ["dshm"]
    assert "privileged" not in c["securityContext"]


def test_rdma_device_plugin_replaces_host_infiniband() -> None:
    spec = kimi_spec(transfer={"protocol": "rdma", "ibDevices": ["mlx5_0"], "rdmaResource": "rdma/ib"})
    _, pod = group_manifests(ctx(spec, Role.PREFILL), 0)
    c = container(pod)
    assert c["resources"]["limits"] == {"nvidia.com/gpu": "8", "rdma/ib": "1"}
    assert "infiniband" not in [v["name"] for v in pod["spec"]["volumes"]]
    assert c["securityContext"] == {"capabilities": {"add": ["IPC_LOCK"]}}


def test_host_network_declares_host_ports_that_differ_between_roles() -> None:
    spec = kimi_spec(transfer={"protocol": "tcp", "hostNetwork": True})
    ports: dict[Role, set[int]] = {}
    for role in Role:
        pod = group_manifests(ctx(spec, role), 0)[1]
        assert pod["spec"]["hostNetwork"] is True
        assert pod["spec"]["dnsPolicy"] == "ClusterFirstWithHostNet"
        declared = container(pod)["ports"]
        assert all(p["hostPort"] == p["containerPort"] for p in declared)
        ports[role] = {p["containerPort"] for p in declared}
    assert ports[Role.PREFILL].isdisjoint(ports[Role.DECODE])


def test_user_env_overrides_operator_env_without_duplicates() -> None:
    spec = kimi_spec(prefill={"env": [{"name": "MC_TE_METRIC", "value": "false"}]})
    env = container(group_manifests(ctx(spec, Role.PREFILL), 0)[1])["env"]
    names = [v["name"] for v in env]
    assert len(names) == len(set(names))
    assert {"name": "MC_TE_METRIC", "value": "false"} in env


def test_offload_env_points_mooncake_at_etcd() -> None:
    env = {v["name"]: v.get("value") for v in container(group_manifests(ctx(kimi_spec(), Role.DECODE), 0)[1])["env"]}
    assert env["MOONCAKE_MASTER"] == "etcd://etcd-0.etcd:2379;etcd-1.etcd:2379"
    assert env["MOONCAKE_TE_META_DATA_SERVER"] == "etcd://etcd-0.etcd:2379;etcd-1.etcd:2379"
    assert env["MC_METADATA_CLUSTER_ID"] == "llm.kimi"
    # rdma, 8 GPUs per pod: one RPC port per rank's Mooncake engine
    assert (env["MC_MIN_RPC_PORT"], env["MC_MAX_RPC_PORT"]) == ("15100", "15107")


def test_template_hash_ignores_group_count_and_other_role() -> None:
    base = kimi_spec()
    scaled = kimi_spec(prefill={**base.to_wire()["prefill"], "groups": 7})
    assert template_hash(base, Role.PREFILL) == template_hash(scaled, Role.PREFILL)
    changed_decode = kimi_spec(decode={**base.to_wire()["decode"], "extraArgs": ["--cuda-graph-max-bs-decode", "480"]})
    assert template_hash(base, Role.PREFILL) == template_hash(changed_decode, Role.PREFILL)
    assert template_hash(base, Role.DECODE) != template_hash(changed_decode, Role.DECODE)
    assert compat_revision(base) == compat_revision(changed_decode)
    new_model = kimi_spec(model={"path": "moonshotai/Kimi-K2.6", "revision": "abc123"})
    assert compat_revision(base) != compat_revision(new_model)


@pytest.mark.parametrize(
    ("existing", "with_replicas"), [(frozenset(), {"prefill": 2, "decode": 1}), (frozenset(Role), {})]
)
def test_pools_carry_replicas_only_when_created(existing: frozenset[Role], with_replicas: dict[str, int]) -> None:
    pools = pool_manifests(CLUSTER, kimi_spec(), existing)
    assert [p["metadata"]["name"] for p in pools] == ["kimi-prefill", "kimi-decode"]
    assert {p["spec"]["role"]: p["spec"]["replicas"] for p in pools if "replicas" in p["spec"]} == with_replicas
    owner = pools[0]["metadata"]["ownerReferences"][0]
    assert (owner["kind"], owner["name"], owner["uid"], owner["controller"]) == ("PDCluster", "kimi", CLUSTER.uid, True)
