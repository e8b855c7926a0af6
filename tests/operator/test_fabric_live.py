"""``spec.fabric`` on the real control plane: kube-scheduler places each group inside one fabric domain of the dev
cluster's labelled kwok nodes, and the operator registers each group with its leader node's domain.

The dev cluster's 8 nodes carry ``topology.tandem.dev/block`` (4 nodes a block, 2 blocks). Groups of 3 nodes (and
one of 2) sit in one block only because of the rule: placed freely, the scheduler spreads a group's pods over the
nodes (one pod a node), and a group lands whole in one block by chance about once in 7 (3 nodes) or 3 in 7 (2).
"""

from __future__ import annotations

import json
from collections.abc import AsyncIterator
from pathlib import Path
from typing import Any

import pytest
from kubernetes_asyncio import client

from tandem.registry import FabricMode
from tandem_dev.devcluster.cluster import DevCluster
from tandem_dev.devcluster.nodes import BLOCK_LABEL
from tandem_dev.devcluster.podrunner import PodRunner
from tandem_dev.procs import ManagedProcess
from tandem_operator.run.render import InvalidClusterError, render
from tests.operator.live import Registry, create_pdcluster, operator_process, pdcluster, pods, ready, run_tool
from tests.tandem_dev.devcluster.devcluster_fixtures import eventually

pytestmark = [pytest.mark.k8s, pytest.mark.timeout(300)]

PREFILL = {"groups": 1, "nodesPerGroup": 2, "tpSize": 2, "gpusPerNode": 1, "epSize": 1, "moeA2ABackend": "none"}
DECODE = {"groups": 2, "nodesPerGroup": 3, "tpSize": 3, "gpusPerNode": 1, "epSize": 1, "moeA2ABackend": "none"}


@pytest.fixture
async def operator(
    k8s_cluster: DevCluster,
    k8s_namespace: str,
    tandem_crds: None,
    etcd_endpoint: str,
    tmp_path: Path,
    health_pods: PodRunner,
) -> AsyncIterator[ManagedProcess]:
    proc = operator_process(k8s_cluster, k8s_namespace, etcd_endpoint, tmp_path, "op-fabric").start()
    try:
        yield proc
    finally:
        proc.stop()


async def test_each_group_is_placed_in_one_domain_and_registered_with_it(
    k8s_api: client.ApiClient, k8s_namespace: str, operator: ManagedProcess, etcd_endpoint: str
) -> None:
    ns = k8s_namespace
    fabric = {"domainLabel": BLOCK_LABEL, "mode": "Required"}
    await create_pdcluster(k8s_api, ns, pdcluster("fab", prefill=PREFILL, decode=DECODE, fabric=fabric))
    await eventually(lambda: ready(k8s_api, ns, "fab", 1, 2), "PDCluster fab Ready", within=120)

    core = client.CoreV1Api(k8s_api)
    blocks = {n.metadata.name: n.metadata.labels[BLOCK_LABEL] for n in (await core.list_node()).items}
    groups: dict[str, dict[int, str]] = {}  # registry group name -> rank -> node
    for pod in await pods(k8s_api, ns):
        labels = pod.metadata.labels
        name = f"{labels['tandem.dev/role']}-{labels['tandem.dev/group']}"
        groups.setdefault(name, {})[int(labels["tandem.dev/rank"])] = pod.spec.node_name
    assert {name: len(ranks) for name, ranks in groups.items()} == {"prefill-0": 2, "decode-0": 3, "decode-1": 3}
    for name, ranks in groups.items():
        assert len(set(ranks.values())) == len(ranks), (name, ranks)  # one pod of a group per node, as before
        assert len({blocks[node] for node in ranks.values()}) == 1, (name, {r: blocks[n] for r, n in ranks.items()})

    async with Registry(etcd_endpoint) as reg:

        async def entries() -> dict[str, Any] | None:
            found = await reg.endpoints(ns, "fab")
            return found if sorted(found) == sorted(groups) else None

        registered = await eventually(entries, "every group registered", within=60)
    for name, endpoint in registered.items():
        assert endpoint.fabric_domain == blocks[groups[name][0]], name  # the leader's node's block
        assert endpoint.fabric_mode is FabricMode.REQUIRED


@pytest.mark.parametrize(
    ("fabric", "field"),
    [
        ({"domainLabel": ""}, "spec.fabric.domainLabel"),
        ({"domainLabel": "rack id"}, "spec.fabric.domainLabel"),
        ({"domainLabel": BLOCK_LABEL, "mode": "Sometimes"}, "spec.fabric.mode"),
        ({"domainLabel": "kubernetes.io/hostname"}, "spec.fabric.domainLabel"),  # the decode group spans 2 nodes
    ],
)
async def test_bad_fabric_specs_are_refused_by_the_api_server_naming_the_field(
    k8s_cluster: DevCluster, k8s_namespace: str, tandem_crds: None, tmp_path: Path, fabric: dict[str, Any], field: str
) -> None:
    manifest = pdcluster("bad", fabric=fabric)
    path = tmp_path / "bad.yaml"
    path.write_text(json.dumps(manifest))
    code, _, err = await run_tool(k8s_cluster, "kubectl", "-n", k8s_namespace, "apply", "-f", str(path), check=False)
    assert code != 0
    assert field in err, err
    with pytest.raises(InvalidClusterError) as offline:  # tandem render: the same field paths and messages
        render(manifest, k8s_namespace)
    assert offline.value.messages
    for line in offline.value.messages:
        assert line in err, (line, err)
