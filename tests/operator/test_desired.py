"""Desired state as data: pods, args, env, volumes and placement of a group (golden) plus focused checks."""

from __future__ import annotations

import os
from pathlib import Path
from typing import Any

import pydantic
import pytest
import yaml

from tandem.registry import Role
from tandem_operator.api.pdcluster import PDClusterSpec
from tandem_operator.desired.naming import ClusterRef, OwnerRef, compat_revision
from tandem_operator.desired.pods import RoleContext, group_manifests
from tandem_operator.desired.pools import pool_manifests

from .conftest import kimi_spec, role_hash

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


def pods_of(manifests: list[dict[str, Any]]) -> list[dict[str, Any]]:
    return [m for m in manifests if m["kind"] == "Pod"]


def test_decode_group_golden() -> None:
    check_golden("decode-group-0", group_manifests(ctx(kimi_spec(), Role.DECODE), 0))


def test_prefill_group_golden() -> None:
    check_golden("prefill-group-1", group_manifests(ctx(kimi_spec(), Role.PREFILL), 1))


RECIPE = Path(__file__).parents[2] / "deploy" / "kimi-k26-h200.yaml"


@pytest.mark.parametrize("role", list(Role))
def test_the_shipped_k26_recipe_golden(role: Role) -> None:
    """What deploy/kimi-k26-h200.yaml runs on the H200s, pod by pod (the fixture above is a generic multi-node
    example): one node a group (W4A16 Marlin MoE), the Store reusing the PD engine, no memory-fraction override."""
    spec = PDClusterSpec.model_validate(yaml.safe_load(RECIPE.read_text())["spec"])
    manifests = group_manifests(ctx(spec, role), 0)
    check_golden(f"kimi-k26-h200-{role.value}-group-0", manifests)
    (pod,) = pods_of(manifests)
    args = container(pod)["args"]
    assert "--mem-fraction-static" not in args
    assert args[args.index("--page-size") + 1] == "64"
    env = {v["name"]: v.get("value") for v in container(pod)["env"]}
    assert "NCCL_SOCKET_IFNAME" not in env  # the entrypoint finds the interface that holds the pod's IP
    if role is Role.PREFILL:
        assert env["MOONCAKE_TE_META_DATA_SERVER"] == "P2PHANDSHAKE"
        assert env["MOONCAKE_GLOBAL_SEGMENT_SIZE"] == "256gb"  # 32 GiB a rank x attention-TP 8


def container(pod: dict[str, Any]) -> dict[str, Any]:
    (only,) = pod["spec"]["containers"]
    assert isinstance(only, dict)
    return only


def flag(command: list[str], name: str) -> str | None:
    return command[command.index(name) + 1] if name in command else None


def test_multi_node_group_ranks_and_leader_address() -> None:
    service, *pods = [m for m in group_manifests(ctx(kimi_spec(), Role.DECODE), 3) if m["kind"] in ("Service", "Pod")]
    assert service["metadata"]["name"] == "kimi-decode-3"
    assert service["spec"]["selector"]["tandem.dev/rank"] == "0"
    assert service["spec"]["publishNotReadyAddresses"] is True
    assert [p["metadata"]["name"] for p in pods] == ["kimi-decode-3-0", "kimi-decode-3-1"]
    for rank, pod in enumerate(pods):
        command = container(pod)["args"]
        assert flag(command, "--dist-init-addr") == "kimi-decode-3.llm.svc:5001"
        assert (flag(command, "--nnodes"), flag(command, "--node-rank")) == ("2", str(rank))
        assert pod["metadata"]["labels"]["tandem.dev/rank"] == str(rank)


def test_only_prefill_leaders_carry_the_bootstrap_annotation() -> None:
    spec = kimi_spec(prefill={"nodesPerGroup": 2, "tpSize": 16, "epSize": 16})
    leader, follower = pods_of(group_manifests(ctx(spec, Role.PREFILL), 0))
    assert leader["metadata"]["annotations"] == {"sglang.ai/bootstrap-port": "8998"}
    assert "annotations" not in follower["metadata"]
    for pod in (leader, follower):
        assert flag(container(pod)["args"], "--disaggregation-bootstrap-port") == "8998"
    decode_leader, _ = pods_of(group_manifests(ctx(kimi_spec(), Role.DECODE), 0))
    assert "annotations" not in decode_leader["metadata"]
    assert "--disaggregation-bootstrap-port" not in container(decode_leader)["args"]


def test_single_node_group_has_no_dist_init() -> None:
    (pod,) = pods_of(group_manifests(ctx(kimi_spec(), Role.PREFILL), 0))
    command = container(pod)["args"]
    assert "--dist-init-addr" not in command
    assert "--nnodes" not in command


def test_tcp_transfer_has_no_infiniband_and_forces_tcp() -> None:
    spec = kimi_spec(transfer={"protocol": "tcp"})
    (pod,) = pods_of(group_manifests(ctx(spec, Role.PREFILL), 0))
    c = container(pod)
    assert "--disaggregation-ib-device" not in c["args"]
    assert {"name": "MC_FORCE_TCP", "value": "true"} in c["env"]
    assert [v["name"] for v in pod["spec"]["volumes"]] == ["dshm", "jit-cache"]
    assert "privileged" not in c["securityContext"]


def test_rdma_device_plugin_replaces_host_infiniband() -> None:
    spec = kimi_spec(transfer={"protocol": "rdma", "ibDevices": ["mlx5_0"], "rdmaResource": "rdma/ib"})
    (pod,) = pods_of(group_manifests(ctx(spec, Role.PREFILL), 0))
    c = container(pod)
    assert c["resources"]["limits"] == {"nvidia.com/gpu": "8", "rdma/ib": "1"}
    assert "infiniband" not in [v["name"] for v in pod["spec"]["volumes"]]
    assert c["securityContext"] == {
        "allowPrivilegeEscalation": False,
        "capabilities": {"drop": ["ALL"], "add": ["IPC_LOCK"]},
    }
    assert pod["spec"]["securityContext"] == {"seccompProfile": {"type": "RuntimeDefault"}}


def test_host_network_declares_host_ports_that_differ_between_roles() -> None:
    spec = kimi_spec(transfer={"protocol": "tcp", "hostNetwork": True})
    ports: dict[Role, set[int]] = {}
    for role in Role:
        pod = pods_of(group_manifests(ctx(spec, role), 0))[0]
        assert pod["spec"]["hostNetwork"] is True
        assert pod["spec"]["dnsPolicy"] == "ClusterFirstWithHostNet"
        declared = container(pod)["ports"]
        assert all(p["hostPort"] == p["containerPort"] for p in declared)
        ports[role] = {p["containerPort"] for p in declared}
    assert ports[Role.PREFILL].isdisjoint(ports[Role.DECODE])


def test_user_env_overrides_operator_env_without_duplicates() -> None:
    spec = kimi_spec(prefill={"env": [{"name": "MC_TE_METRIC", "value": "false"}]})
    env = container(pods_of(group_manifests(ctx(spec, Role.PREFILL), 0))[0])["env"]
    names = [v["name"] for v in env]
    assert len(names) == len(set(names))
    assert {"name": "MC_TE_METRIC", "value": "false"} in env


def test_the_store_reuses_each_ranks_pd_engine_over_rdma() -> None:
    # SGLang 0.5.23 MooncakeStore.__init__ reuses the PD engine when the metadata server is P2PHANDSHAKE, the protocol
    # rdma and MOONCAKE_DEVICE the engine's own device string (--disaggregation-ib-device).
    pod = pods_of(group_manifests(ctx(kimi_spec(), Role.DECODE), 0))[0]
    env = {v["name"]: v.get("value") for v in container(pod)["env"]}
    command = container(pod)["args"]
    assert env["MOONCAKE_MASTER"] == "etcd://etcd-0.etcd:2379;etcd-1.etcd:2379"
    assert env["MOONCAKE_TE_META_DATA_SERVER"] == "P2PHANDSHAKE"
    assert env["MOONCAKE_PROTOCOL"] == "rdma"
    assert env["MOONCAKE_DEVICE"] == command[command.index("--disaggregation-ib-device") + 1]
    assert env["MOONCAKE_LOCAL_HOSTNAME"] == "$(POD_IP)"  # an engine of its own (tcp) registers under the pod's IP
    assert env["MC_STORE_CLUSTER_ID"] == "tandem"  # the chart's mooncakeMaster.clusterId
    assert env["MC_METADATA_CLUSTER_ID"] == "llm.kimi"
    # rdma, 8 GPUs per pod: one RPC port per rank's Mooncake engine, the Store's included
    assert (env["MC_MIN_RPC_PORT"], env["MC_MAX_RPC_PORT"]) == ("15100", "15107")
    assert env["MOONCAKE_GLOBAL_SEGMENT_SIZE"] == "0gb"  # mooncake_store._parse_global_segment_size: "<n>gb"


def test_mooncake_keys_go_to_their_own_etcd_when_named() -> None:
    etcd = {
        "endpoints": ["https://registry.llm.svc:2379"],
        "mooncakeEndpoints": ["http://mc-0.mc:2379", "http://mc-1.mc:2379"],
    }
    spec = kimi_spec(etcd=etcd)
    env = {v["name"]: v.get("value") for v in container(pods_of(group_manifests(ctx(spec, Role.DECODE), 0))[0])["env"]}
    assert env["MOONCAKE_MASTER"] == "etcd://mc-0.mc:2379;mc-1.mc:2379"
    assert role_hash(spec, Role.DECODE) != role_hash(kimi_spec(), Role.DECODE)  # the pods roll onto it
    with pytest.raises(pydantic.ValidationError, match="mooncakeEndpoints"):  # Mooncake's client has no TLS
        kimi_spec(etcd={"endpoints": ["https://r:2379"], "mooncakeEndpoints": ["https://mc:2379"]})


def test_template_hash_ignores_group_count_and_other_role() -> None:
    base = kimi_spec()
    scaled = kimi_spec(prefill={**base.to_wire()["prefill"], "groups": 7})
    assert role_hash(base, Role.PREFILL) == role_hash(scaled, Role.PREFILL)
    changed_decode = kimi_spec(decode={**base.to_wire()["decode"], "extraArgs": ["--stream-interval", "2"]})
    assert role_hash(base, Role.PREFILL) == role_hash(changed_decode, Role.PREFILL)
    assert role_hash(base, Role.DECODE) != role_hash(changed_decode, Role.DECODE)
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


def test_recipe_env_volumes_and_gang_objects() -> None:
    spec = kimi_spec(
        transfer={"protocol": "rdma", "ibDevices": ["mlx5_0", "mlx5_1"], "socketInterface": "eth0", "ibGidIndex": 3},
        scheduling={"schedulerName": "volcano", "podGroup": "volcano"},
        model={
            "path": "/models/Kimi-K2.6",
            "weightCache": {"hostPath": "/mnt/nvme/models", "repo": "moonshotai/Kimi-K2.6"},
            "contextLength": 262144,
            "speculative": {"enabled": True},
        },
    )
    manifests = group_manifests(ctx(spec, Role.DECODE), 0)
    kinds = [m["kind"] for m in manifests]
    assert kinds == ["Service", "PodDisruptionBudget", "PodGroup", "Pod", "Pod"]
    group = {"tandem.dev/cluster": "kimi", "tandem.dev/role": "decode", "tandem.dev/group": "0"}
    assert manifests[1]["spec"] == {"maxUnavailable": 0, "selector": {"matchLabels": group}}
    assert manifests[2]["spec"] == {"minMember": 2}
    pod = manifests[3]
    env = {v["name"]: v.get("value") for v in container(pod)["env"]}
    assert env["NCCL_IB_HCA"] == env["NVSHMEM_HCA_LIST"] == "mlx5_0,mlx5_1"
    assert env["NCCL_SOCKET_IFNAME"] == env["GLOO_SOCKET_IFNAME"] == "eth0"
    assert env["NCCL_IB_GID_INDEX"] == env["NVSHMEM_IB_GID_INDEX"] == "3"
    assert env["SGLANG_CACHE_DIR"] == "/var/cache/sglang"
    assert pod["spec"]["schedulerName"] == "volcano"
    assert pod["metadata"]["annotations"]["scheduling.k8s.io/group-name"] == "kimi-decode-0"
    (init,) = pod["spec"]["initContainers"]
    assert init["command"][3:5] == ["moonshotai/Kimi-K2.6", "/models/Kimi-K2.6"]
    assert init["securityContext"] == {"allowPrivilegeEscalation": False, "capabilities": {"drop": ["ALL"]}}
    assert init["resources"] == {"requests": {"cpu": "96", "memory": "1500Gi"}}  # the worker's, without GPUs
    mounts = {m["name"]: m["mountPath"] for m in container(pod)["volumeMounts"]}
    assert mounts["weights"] == "/models"
    assert mounts["jit-cache"] == "/var/cache/sglang"
    command = container(pod)["args"]
    assert command[command.index("--context-length") + 1] == "262144"
    assert command[command.index("--speculative-draft-model-path") + 1] == "lightseekorg/kimi-k2.6-eagle3.1-mla"


@pytest.mark.parametrize("host_network", [True, False])
def test_every_worker_tells_sglang_its_pod_ip(host_network: bool) -> None:
    spec = kimi_spec(transfer={"protocol": "rdma", "ibDevices": ["mlx5_0"], "hostNetwork": host_network})
    for role in Role:
        for pod in pods_of(group_manifests(ctx(spec, role), 0)):
            assert "command" not in container(pod)  # the image's ENTRYPOINT (the preflight) runs the args
            env = {v["name"]: v for v in container(pod)["env"]}
            assert env["SGLANG_HOST_IP"] == {
                "name": "SGLANG_HOST_IP",
                "valueFrom": {"fieldRef": {"fieldPath": "status.podIP"}},
            }
            assert env["TANDEM_TRANSFER_PROTOCOL"]["value"] == "rdma"


def test_rdma_without_devices_or_interface_leaves_them_to_the_entrypoint() -> None:
    spec = kimi_spec(transfer={"protocol": "rdma", "hostNetwork": True})
    env = {v["name"]: v.get("value") for v in container(pods_of(group_manifests(ctx(spec, Role.DECODE), 0))[0])["env"]}
    assert env["TANDEM_TRANSFER_PROTOCOL"] == "rdma"
    for name in ("NCCL_IB_HCA", "NVSHMEM_HCA_LIST", "NCCL_SOCKET_IFNAME", "GLOO_SOCKET_IFNAME"):
        assert name not in env


def test_an_nccl_only_socket_interface_form_is_not_given_to_gloo() -> None:
    spec = kimi_spec(transfer={"protocol": "tcp", "socketInterface": "^docker,lo"})
    env = {v["name"]: v.get("value") for v in container(pods_of(group_manifests(ctx(spec, Role.DECODE), 0))[0])["env"]}
    assert env["NCCL_SOCKET_IFNAME"] == "^docker,lo"
    assert "GLOO_SOCKET_IFNAME" not in env  # the entrypoint gives Gloo the interface that holds the pod's IP
    assert env["TANDEM_TRANSFER_PROTOCOL"] == "tcp"


def test_chunked_prefill_is_per_attention_dp_rank() -> None:
    spec = kimi_spec(decode={**kimi_spec().to_wire()["decode"], "chunkedPrefillSize": 4096})
    command = container(pods_of(group_manifests(ctx(spec, Role.DECODE), 0))[0])["args"]
    assert command[command.index("--chunked-prefill-size") + 1] == str(4096 * 16)  # attnDpSize 16


def test_prefill_hicache_with_mooncake_store_and_host_memory_check() -> None:
    hicache = {
        "enabled": True,
        "hostMemoryGib": 96,
        "storageBackend": "mooncake",
        "mooncakeStore": {"globalSegmentGib": 32},
    }
    spec = kimi_spec(prefill={"hicache": hicache, "nodeMemoryGib": 2048})
    pod = pods_of(group_manifests(ctx(spec, Role.PREFILL), 0))[0]
    command = container(pod)["args"]
    assert command[command.index("--hicache-size") + 1] == "96"
    assert "--enable-hierarchical-cache" in command
    env = {v["name"]: v.get("value") for v in container(pod)["env"]}
    # 32 GiB per rank: SGLang divides the variable by the attention-TP size (8 here) x PP size per rank
    assert env["MOONCAKE_GLOBAL_SEGMENT_SIZE"] == "256gb"
    with pytest.raises(ValueError, match="must fit nodeMemoryGib"):
        kimi_spec(prefill={"hicache": hicache, "nodeMemoryGib": 1000})  # (96 + 32) x 8 = 1024 GiB


@pytest.mark.parametrize(
    ("resources", "requests"),
    [
        ({}, {"cpu": "1", "memory": "4Gi"}),  # never BestEffort
        ({"requests": {"cpu": 96, "memory": "1500Gi"}}, {"cpu": "96", "memory": "1500Gi"}),
        ({"requests": {"cpu": 8}}, {"cpu": "8", "memory": "4Gi"}),
        # A limit alone: the API server defaults the request to it, so no floor may exceed it.
        ({"limits": {"memory": "2Gi"}}, {"cpu": "1"}),
    ],
)
def test_worker_requests_have_a_cpu_and_memory_floor(resources: dict[str, Any], requests: dict[str, str]) -> None:
    spec = kimi_spec(prefill={**kimi_spec().to_wire()["prefill"], "resources": resources})
    c = container(pods_of(group_manifests(ctx(spec, Role.PREFILL), 0))[0])
    assert c["resources"]["requests"] == {**requests, "nvidia.com/gpu": "8"}


def test_the_segment_is_per_rank_under_attention_dp_too() -> None:
    offload = {"enabled": True, "storageBackend": "mooncake", "mooncakeStore": {"globalSegmentGib": 4}}
    spec = kimi_spec(decode={"attnDpSize": 8, "kvOffload": offload})  # attention-TP size 16 / 8 = 2
    env = {v["name"]: v.get("value") for v in container(pods_of(group_manifests(ctx(spec, Role.DECODE), 0))[0])["env"]}
    assert env["MOONCAKE_GLOBAL_SEGMENT_SIZE"] == f"{4 * spec.decode.attn_tp_size}gb"
    assert spec.decode.attn_tp_size == spec.decode.tp_size // 8


def test_both_roles_get_one_page_size_64_by_default_with_a_store() -> None:
    def page_size(spec: Any, role: Role) -> str | None:
        command = container(pods_of(group_manifests(ctx(spec, role), 0))[0])["args"]
        return command[command.index("--page-size") + 1] if "--page-size" in command else None

    spec = kimi_spec()  # decode KV offload: a Mooncake Store
    assert page_size(spec, Role.PREFILL) == page_size(spec, Role.DECODE) == "64"
    chosen = kimi_spec(pageSize=32)
    assert page_size(chosen, Role.PREFILL) == page_size(chosen, Role.DECODE) == "32"
    no_store = kimi_spec(decode={"kvOffload": {"enabled": False}})
    assert page_size(no_store, Role.PREFILL) is None  # SGLang's own default, the same for both roles
    assert page_size(no_store, Role.DECODE) is None
    with pytest.raises(pydantic.ValidationError, match=r"extraArgs may not set flags the operator manages"):
        kimi_spec(decode={"extraArgs": ["--page-size=16"]})  # a mismatch with the prefill kills the decode


def test_decode_batch_and_graphs_follow_attention_dp() -> None:
    spec = kimi_spec(decode={**kimi_spec().to_wire()["decode"], "maxRunningRequests": 512})  # attnDpSize 16
    command = container(pods_of(group_manifests(ctx(spec, Role.DECODE), 0))[0])["args"]
    assert command[command.index("--max-running-requests") + 1] == "512"
    assert command[command.index("--cuda-graph-max-bs-decode") + 1] == "32"  # 512 // 16: one rank's share
    with pytest.raises(pydantic.ValidationError, match="maxRunningRequests must be a multiple of attnDpSize"):
        kimi_spec(decode={**kimi_spec().to_wire()["decode"], "maxRunningRequests": 100})


def test_a_w4a16_checkpoint_runs_one_node_a_group_with_standard_dispatch() -> None:
    w4a16 = {**kimi_spec().to_wire()["model"], "moeQuantization": "w4a16"}
    with pytest.raises(pydantic.ValidationError, match=r"decode: model\.moeQuantization w4a16"):
        kimi_spec(model=w4a16)  # the fixture's decode spans 2 nodes
    one_node = {"groups": 1, "nodesPerGroup": 1, "tpSize": 8, "epSize": 8, "attnDpSize": 8}
    assert kimi_spec(model=w4a16, decode=one_node).model.moe_quantization == "w4a16"
    with pytest.raises(pydantic.ValidationError, match=r"prefill: model\.moeQuantization w4a16"):
        kimi_spec(model=w4a16, decode=one_node, prefill={"moeA2ABackend": "deepep"})
    with pytest.raises(pydantic.ValidationError, match="enableEplb needs epSize > 1"):
        kimi_spec(prefill={"enableEplb": True, "epSize": 1})
