"""The operator on the real test control plane (kube-apiserver + etcd + scheduler + kwok GPU nodes).

Each test runs its own ``tandem operator`` process (as a user would) serving only the test's namespace, with the
endpoint registry in the session's etcd. Nothing is mocked.
"""

from __future__ import annotations

import itertools
import json
from collections.abc import AsyncIterator
from pathlib import Path
from typing import Any

import pytest
from kubernetes_asyncio import client

from tandem import registry
from tandem_dev.devcluster.cluster import DevCluster
from tandem_dev.devcluster.podrunner import PodRunner
from tandem_dev.procs import ManagedProcess
from tandem_operator.decide.recovery import fence_annotation
from tandem_operator.run.render import InvalidClusterError, render
from tests.operator.live import (
    SIM_SPEC,
    Registry,
    create_pdcluster,
    operator_process,
    pdcluster,
    pods,
    ready,
    run_tool,
)
from tests.tandem_dev.devcluster.devcluster_fixtures import eventually

pytestmark = [pytest.mark.k8s, pytest.mark.timeout(240)]
PORTS = {"http": 30001, "bootstrap": 8999, "distInit": 5001}


@pytest.fixture
async def operator(
    k8s_cluster: DevCluster,
    k8s_namespace: str,
    tandem_crds: None,
    etcd_endpoint: str,
    tmp_path: Path,
    health_pods: PodRunner,
) -> AsyncIterator[ManagedProcess]:
    proc = operator_process(k8s_cluster, k8s_namespace, etcd_endpoint, tmp_path, "op-a").start()
    try:
        yield proc
    finally:
        proc.stop()


async def test_a_pdcluster_becomes_ready_with_the_right_pods_and_scales(
    k8s_cluster: DevCluster, k8s_api: client.ApiClient, k8s_namespace: str, operator: ManagedProcess, etcd_endpoint: str
) -> None:
    ns = k8s_namespace
    await create_pdcluster(k8s_api, ns, pdcluster("sim"))
    await eventually(lambda: ready(k8s_api, ns, "sim", 1, 1), "PDCluster sim Ready", within=60)

    by_name = {p.metadata.name: p for p in await pods(k8s_api, ns)}
    assert sorted(by_name) == ["sim-decode-0-0", "sim-decode-0-1", "sim-prefill-0-0"]
    leader, follower = by_name["sim-decode-0-0"], by_name["sim-decode-0-1"]
    command = leader.spec.containers[0].args
    assert command[:3] == ["python3", "-m", "sglang.launch_server"]
    flags = dict(itertools.pairwise(command))
    assert flags["--dist-init-addr"] == f"sim-decode-0.{ns}.svc:5001"
    assert (flags["--nnodes"], flags["--disaggregation-mode"], flags["--tp-size"]) == ("2", "decode", "2")
    assert follower.spec.containers[0].args[command.index("--node-rank") + 1] == "1"
    env = {e.name: e.value for e in leader.spec.containers[0].env if e.value is not None}
    assert (env["MC_MIN_RPC_PORT"], env["MC_MAX_RPC_PORT"], env["MC_FORCE_TCP"]) == ("15100", "15101", "true")
    assert leader.spec.containers[0].resources.limits["nvidia.com/gpu"] == "1"
    assert "IPC_LOCK" in leader.spec.containers[0].security_context.capabilities.add
    assert [v.empty_dir.medium for v in leader.spec.volumes if v.name == "dshm"] == ["Memory"]
    assert leader.spec.node_name != follower.spec.node_name  # one pod of a group per node
    assert leader.metadata.annotations["tandem.dev/epoch"] == "0"
    prefill = by_name["sim-prefill-0-0"]
    assert prefill.metadata.annotations["sglang.ai/bootstrap-port"] == "8998"
    service = await client.CoreV1Api(k8s_api).read_namespaced_service("sim-decode-0", ns)
    assert service.spec.cluster_ip == "None"
    assert service.spec.selector["tandem.dev/rank"] == "0"
    _, table, _ = await run_tool(k8s_cluster, "kubectl", "-n", ns, "get", "pdc", "sim")
    assert table.split("\n")[1].split()[:4] == ["sim", "1", "1", "Ready"], table  # ready groups per role

    async with Registry(etcd_endpoint) as reg:
        entries = await reg.endpoints(ns, "sim")
        assert sorted(entries) == ["decode-0", "prefill-0"]
        assert entries["decode-0"].url == f"http://{leader.status.pod_ip}:30001"
        assert entries["prefill-0"].bootstrap_port == 8998

        await run_tool(k8s_cluster, "kubectl", "-n", ns, "scale", "pdpool/sim-decode", "--replicas=2")
        await eventually(lambda: ready(k8s_api, ns, "sim", 1, 2), "two decode groups Ready", within=60)

        async def registered(groups: list[str]) -> bool:
            return sorted(await reg.endpoints(ns, "sim")) == groups

        await eventually(lambda: registered(["decode-0", "decode-1", "prefill-0"]), "decode-1 registered", within=30)
        assert len(await pods(k8s_api, ns, "tandem.dev/role=decode")) == 4

        await run_tool(k8s_cluster, "kubectl", "-n", ns, "scale", "pdpool/sim-decode", "--replicas=1")
        await eventually(lambda: registered(["decode-0", "prefill-0"]), "decode-1 unregistered", within=30)

        async def two_decode_pods() -> bool:
            return sorted(p.metadata.name for p in await pods(k8s_api, ns, "tandem.dev/role=decode")) == [
                "sim-decode-0-0",
                "sim-decode-0-1",
            ]

        await eventually(two_decode_pods, "decode-1's pods deleted", within=30)
        await eventually(lambda: ready(k8s_api, ns, "sim", 1, 1), "back to one decode group", within=30)
        pools = await client.CustomObjectsApi(k8s_api).get_namespaced_custom_object(
            "tandem.dev", "v1alpha1", ns, "pdpools", "sim-decode"
        )
        assert pools["spec"]["replicas"] == 1
        assert pools["status"]["readyReplicas"] == 1


@pytest.mark.parametrize(
    ("change", "field", "message"),
    [
        ({"decode": {"groups": 1, "nodesPerGroup": 2, "gpusPerNode": 1, "tpSize": 4}}, "spec.decode", "tpSize"),
        (
            {"transfer": {"protocol": "tcp", "ibDevices": ["mlx5_0"]}},
            "spec.transfer.ibDevices",
            "ibDevices needs protocol rdma",
        ),
        ({"router": {"policy": "least_load"}}, "spec.router.policy", "Unsupported value"),
        (
            {"prefill": {"groups": 1, "gpusPerNode": 2, "tpSize": 2, "epSize": 1, "moeA2ABackend": "deepep"}},
            "spec.prefill.epSize",
            "moeA2ABackend deepep needs epSize == tpSize",
        ),
        (
            {"lifecycle": {"modelLoadTimeoutSeconds": 7200, "startDeadlineSeconds": 3600}},
            "spec.lifecycle.startDeadlineSeconds",
            "startDeadlineSeconds must exceed modelLoadTimeoutSeconds",
        ),
        (
            {"lifecycle": {"nodeLostGraceSeconds": -1}},
            "spec.lifecycle.nodeLostGraceSeconds",
            "spec.lifecycle.nodeLostGraceSeconds in body should be greater than or equal to 0",
        ),
        (  # tcp, 1 GPU per pod: [32767, 32768] touches the ephemeral ports
            {
                "decode": {
                    **SIM_SPEC["decode"],
                    "ports": {"http": 30001, "bootstrap": 8999, "distInit": 5001, "mooncakeRpc": 32767},
                }
            },
            "spec.decode.ports.mooncakeRpc",
            "must lie within 1024-32767 or 61000-65535",
        ),
        (
            {"prefill": {**SIM_SPEC["prefill"], "ports": {**PORTS, "mooncakeRpc": 15000, "mooncakePorts": 1}}},
            "spec.prefill.ports.mooncakePorts",
            "prefill.ports.mooncakePorts must hold one pod's window",
        ),
    ],
)
async def test_invalid_specs_are_rejected_by_the_api_server_with_field_paths(
    k8s_cluster: DevCluster,
    k8s_namespace: str,
    tandem_crds: None,
    tmp_path: Path,
    change: dict[str, Any],
    field: str,
    message: str,
) -> None:
    manifest = pdcluster("bad", **change)
    path = tmp_path / "bad.yaml"
    path.write_text(json.dumps(manifest))
    code, _, err = await run_tool(k8s_cluster, "kubectl", "-n", k8s_namespace, "apply", "-f", str(path), check=False)
    assert code != 0
    assert field in err, err
    assert message in err, err
    with pytest.raises(InvalidClusterError) as offline:  # tandem render: the same field paths and messages
        render(manifest, k8s_namespace)
    for line in offline.value.messages:
        assert line in err, (line, err)


async def test_a_restarted_operator_keeps_pods_and_registrations_and_finishes_a_recorded_fence(
    k8s_cluster: DevCluster, k8s_api: client.ApiClient, k8s_namespace: str, operator: ManagedProcess, etcd_endpoint: str
) -> None:
    ns = k8s_namespace
    await create_pdcluster(k8s_api, ns, pdcluster("sim", decode_groups=2))
    await eventually(lambda: ready(k8s_api, ns, "sim", 1, 2), "PDCluster sim Ready", within=60)
    async with Registry(etcd_endpoint) as reg:

        async def three() -> bool:
            return len(await reg.endpoints(ns, "sim")) == 3

        await eventually(three, "three groups registered", within=30)
        before = {p.metadata.name: p.metadata.uid for p in await pods(k8s_api, ns)}
        operator.stop()
        # The state an operator leaves when it dies right after fencing decode-1 (a member failed) and before
        # recreating it: the registry key deleted, the fence recorded on the group's Service.
        await reg.client.delete(f"{registry.cluster_prefix(ns, 'sim')}decode/decode-1".encode())
        await client.CoreV1Api(k8s_api).patch_namespaced_service("sim-decode-1", ns, fence_annotation(0, "PodFailed"))
        successor = operator_process(k8s_cluster, ns, etcd_endpoint, operator.log_path.parent, "op-b").start()
        try:

            async def recovered() -> bool:
                entries = await reg.endpoints(ns, "sim")
                return sorted(entries) == ["decode-0", "decode-1", "prefill-0"] and entries["decode-1"].epoch == 1

            await eventually(recovered, "decode-1 recreated and registered with epoch 1", within=60)
            after = {p.metadata.name: p.metadata.uid for p in await pods(k8s_api, ns)}
            assert sorted(after) == sorted(before)  # no duplicates
            untouched = ["sim-prefill-0-0", "sim-decode-0-0", "sim-decode-0-1"]
            assert [after[n] for n in untouched] == [before[n] for n in untouched]
            assert after["sim-decode-1-0"] != before["sim-decode-1-0"]  # the fenced group was recreated
            assert len(await reg.leases(ns, "sim")) == 1  # every entry re-put under the successor's lease
            entries = await reg.endpoints(ns, "sim")
            assert (entries["prefill-0"].epoch, entries["decode-0"].epoch) == (0, 0)
        finally:
            successor.stop()
