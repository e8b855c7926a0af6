"""`helm uninstall` of a default install (embedded etcd with persistence) leaves exactly what NOTES.txt says it
keeps: the etcd members' PersistentVolumeClaims (and the CRDs, which Helm never deletes).

The test cluster has no volume provisioner, so the claims stay Pending (and the etcd pods with them); the
StatefulSet controller creates them all the same, which is what the uninstall question is about.
"""

from __future__ import annotations

import re

import pytest
from kubernetes_asyncio import client

from tandem_dev.devcluster.cluster import DevCluster
from tests.chart.stack import CHART, cluster_objects_of_release, namespace_objects, tool
from tests.tandem_dev.devcluster.devcluster_fixtures import eventually

pytestmark = [pytest.mark.k8s, pytest.mark.timeout(180)]

RELEASE = "tandem-pvc"


async def test_uninstall_keeps_only_the_etcd_claims(
    k8s_cluster: DevCluster, k8s_api: client.ApiClient, k8s_namespace: str
) -> None:
    ns = k8s_namespace
    notes = await tool(k8s_cluster, "helm", "install", RELEASE, str(CHART), "-n", ns)
    kept = re.search(r"etcd PersistentVolumeClaims \((data-[a-z0-9-]+-etcd-)\*\)", notes)
    assert kept, notes
    core = client.CoreV1Api(k8s_api)

    async def claims() -> list[str] | None:
        names = sorted(c.metadata.name for c in (await core.list_namespaced_persistent_volume_claim(ns)).items)
        return names if len(names) == 3 else None

    names = await eventually(claims, "the StatefulSet's 3 claims", within=60)
    assert names == [f"{kept.group(1)}{i}" for i in range(3)]
    assert await cluster_objects_of_release(k8s_cluster, RELEASE) != []

    await tool(k8s_cluster, "helm", "uninstall", RELEASE, "-n", ns, "--wait", "--timeout", "60s")

    async def settled() -> list[tuple[str, str]] | None:
        left = await namespace_objects(k8s_cluster, ns)
        return left if all(kind == "PersistentVolumeClaim" for kind, _ in left) else None

    left = await eventually(settled, "uninstall to settle", within=60)
    assert left == [("PersistentVolumeClaim", name) for name in names]
    assert await cluster_objects_of_release(k8s_cluster, RELEASE) == []
