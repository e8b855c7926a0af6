"""The real test control plane: scheduling onto fake GPU nodes, garbage collection, Helm and RBAC.

Everything here talks to a real kube-apiserver (with etcd, controller-manager, scheduler and kwok) started once
per session by the ``k8s_cluster`` fixture; nothing is mocked.
"""

from __future__ import annotations

import asyncio
import ipaddress
import json
import os
from collections.abc import Awaitable, Callable
from pathlib import Path
from typing import Any

import pytest
from kubernetes_asyncio import client
from kubernetes_asyncio import config as kube_config

from tandem_dev.devcluster.cluster import DevCluster
from tandem_dev.devcluster.components import SERVICE_ACCOUNT_ISSUER
from tandem_dev.devcluster.config import K8S_VERSION
from tandem_dev.devcluster.nodes import BLOCK_LABEL, GPU_RESOURCE, RDMA_RESOURCE
from tests.tandem_dev.devcluster.devcluster_fixtures import CLUSTER_NODES, create, eventually

pytestmark = [pytest.mark.k8s, pytest.mark.timeout(240)]

REPO = Path(__file__).resolve().parents[3]
TINY_CHART = REPO / "tests" / "fixtures" / "charts" / "tiny"


def gpu_pod_spec(gpus: int, image: str = "registry.invalid/worker:1") -> dict[str, Any]:
    limits = {GPU_RESOURCE: str(gpus), RDMA_RESOURCE: "1"} if gpus else {}
    return {"containers": [{"name": "worker", "image": image, "resources": {"limits": limits}}]}


def deployment(name: str, replicas: int, gpus: int) -> dict[str, Any]:
    labels = {"app": name}
    return {
        "apiVersion": "apps/v1",
        "kind": "Deployment",
        "metadata": {"name": name},
        "spec": {
            "replicas": replicas,
            "selector": {"matchLabels": labels},
            "template": {"metadata": {"labels": labels}, "spec": gpu_pod_spec(gpus)},
        },
    }


async def run_tool(
    cluster: DevCluster, tool: str, *args: str, kubeconfig: Path | None = None, check: bool = True
) -> tuple[int, str]:
    """Run the cluster's kubectl/helm; returns (exit code, stdout). ``check`` fails the test on a non-zero exit."""
    env = {**os.environ, **cluster.env()}
    if kubeconfig is not None:
        env["KUBECONFIG"] = str(kubeconfig)
    proc = await asyncio.create_subprocess_exec(
        str(cluster.tool(tool)), *args, env=env, stdout=asyncio.subprocess.PIPE, stderr=asyncio.subprocess.PIPE
    )
    async with asyncio.timeout(120):
        out, err = await proc.communicate()
    code = proc.returncode
    assert code is not None
    if check:
        assert code == 0, f"{tool} {' '.join(args)} failed ({code}): {err.decode()}{out.decode()}"
    return code, out.decode()


async def pods_of(core: client.CoreV1Api, namespace: str, selector: str) -> list[client.V1Pod]:
    return list((await core.list_namespaced_pod(namespace, label_selector=selector)).items)


async def test_binaries_report_the_pinned_versions(k8s_cluster: DevCluster, k8s_api: client.ApiClient) -> None:
    info = await client.VersionApi(k8s_api).get_code()
    assert info.git_version == K8S_VERSION
    _, etcd = await run_tool(k8s_cluster, "etcd", "--version")
    assert "etcd Version: 3.6." in etcd
    kubectl = json.loads((await run_tool(k8s_cluster, "kubectl", "version", "-o", "json"))[1])
    assert kubectl["serverVersion"]["gitVersion"] == K8S_VERSION
    assert kubectl["clientVersion"]["gitVersion"].startswith("v1.34.")
    assert (await run_tool(k8s_cluster, "helm", "version", "--short"))[1].startswith("v4.")


async def test_fake_gpu_nodes_advertise_gpus_rdma_and_topology(k8s_api: client.ApiClient) -> None:
    nodes = (await client.CoreV1Api(k8s_api).list_node(label_selector="type=kwok")).items
    assert len(nodes) == CLUSTER_NODES
    for node in nodes:
        assert node.status.allocatable[GPU_RESOURCE] == "8"
        assert node.status.capacity[RDMA_RESOURCE] == "1"
        assert any(c.type == "Ready" and c.status == "True" for c in node.status.conditions)
    blocks = sorted({node.metadata.labels[BLOCK_LABEL] for node in nodes})
    assert blocks == ["block-0", "block-1"]


async def test_deployment_schedules_onto_gpu_nodes_and_becomes_ready(
    k8s_api: client.ApiClient, k8s_namespace: str
) -> None:
    apps, core = client.AppsV1Api(k8s_api), client.CoreV1Api(k8s_api)
    await create(k8s_api, k8s_namespace, deployment("workers", replicas=3, gpus=8))

    async def available() -> bool:
        dep = await apps.read_namespaced_deployment("workers", k8s_namespace)
        return dep.status.available_replicas == 3

    await eventually(available, "3 available replicas")
    pods = await pods_of(core, k8s_namespace, "app=workers")
    assert len(pods) == 3
    # 8 GPUs each: no two pods can share an 8-GPU node.
    assert len({pod.spec.node_name for pod in pods}) == 3
    pod_cidr = ipaddress.ip_network("127.10.0.0/16")
    for pod in pods:
        assert pod.status.phase == "Running"
        assert ipaddress.ip_address(pod.status.pod_ip) in pod_cidr
        assert ipaddress.ip_address(pod.status.pod_ip) != pod_cidr.network_address


async def test_statefulset_schedules_and_becomes_ready(k8s_api: client.ApiClient, k8s_namespace: str) -> None:
    apps, core = client.AppsV1Api(k8s_api), client.CoreV1Api(k8s_api)
    labels = {"app": "group"}
    service = {"apiVersion": "v1", "kind": "Service", "metadata": {"name": "group"}}
    service["spec"] = {"clusterIP": "None", "selector": labels, "ports": [{"port": 1}]}
    await create(k8s_api, k8s_namespace, service)
    sts = {
        "apiVersion": "apps/v1",
        "kind": "StatefulSet",
        "metadata": {"name": "group"},
        "spec": {
            "serviceName": "group",
            "replicas": 2,
            "selector": {"matchLabels": labels},
            "template": {"metadata": {"labels": labels}, "spec": gpu_pod_spec(4)},
        },
    }
    await create(k8s_api, k8s_namespace, sts)

    async def ready() -> bool:
        status = (await apps.read_namespaced_stateful_set("group", k8s_namespace)).status
        return status.ready_replicas == 2

    await eventually(ready, "2 ready StatefulSet replicas")
    names = sorted(pod.metadata.name for pod in await pods_of(core, k8s_namespace, "app=group"))
    assert names == ["group-0", "group-1"]


async def test_more_gpus_than_any_node_has_stays_pending(k8s_api: client.ApiClient, k8s_namespace: str) -> None:
    core = client.CoreV1Api(k8s_api)
    pod = {"apiVersion": "v1", "kind": "Pod", "metadata": {"name": "too-big"}, "spec": gpu_pod_spec(9)}
    await create(k8s_api, k8s_namespace, pod)

    async def unschedulable() -> client.V1PodCondition | None:
        status = (await core.read_namespaced_pod("too-big", k8s_namespace)).status
        return next((c for c in status.conditions or [] if c.type == "PodScheduled" and c.status == "False"), None)

    condition = await eventually(unschedulable, "the scheduler to reject the pod")
    assert condition.reason == "Unschedulable"
    assert f"Insufficient {GPU_RESOURCE}" in condition.message
    await asyncio.sleep(2)
    final = await core.read_namespaced_pod("too-big", k8s_namespace)
    assert final.status.phase == "Pending"
    assert final.spec.node_name is None


async def test_deleting_a_nodes_pods_removes_them_and_the_deployment_replaces_them(
    k8s_api: client.ApiClient, k8s_namespace: str
) -> None:
    apps, core = client.AppsV1Api(k8s_api), client.CoreV1Api(k8s_api)
    await create(k8s_api, k8s_namespace, deployment("spread", replicas=4, gpus=2))

    async def available() -> bool:
        return (await apps.read_namespaced_deployment("spread", k8s_namespace)).status.available_replicas == 4

    await eventually(available, "4 available replicas")
    victim_node = (await pods_of(core, k8s_namespace, "app=spread"))[0].spec.node_name
    selector = f"spec.nodeName={victim_node}"
    doomed = {p.metadata.uid for p in (await core.list_namespaced_pod(k8s_namespace, field_selector=selector)).items}
    assert doomed
    await core.delete_collection_namespaced_pod(k8s_namespace, field_selector=selector)

    async def gone_and_replaced() -> bool:
        pods = await pods_of(core, k8s_namespace, "app=spread")
        uids = {p.metadata.uid for p in pods}
        ready = [p for p in pods if p.status.phase == "Running" and p.metadata.deletion_timestamp is None]
        return not (uids & doomed) and len(ready) == 4

    await eventually(gone_and_replaced, "the node's pods to be deleted and replaced")


async def test_garbage_collector_deletes_owned_objects(k8s_api: client.ApiClient, k8s_namespace: str) -> None:
    apps, core = client.AppsV1Api(k8s_api), client.CoreV1Api(k8s_api)
    owner = await create(
        k8s_api, k8s_namespace, {"apiVersion": "v1", "kind": "ConfigMap", "metadata": {"name": "owner"}}
    )
    ref = {"apiVersion": "v1", "kind": "ConfigMap", "name": "owner", "uid": owner.metadata.uid}
    dependent = {"apiVersion": "v1", "kind": "ConfigMap", "metadata": {"name": "dependent", "ownerReferences": [ref]}}
    await create(k8s_api, k8s_namespace, dependent)
    await core.delete_namespaced_config_map("owner", k8s_namespace)

    async def dependent_gone() -> bool:
        names = {cm.metadata.name for cm in (await core.list_namespaced_config_map(k8s_namespace)).items}
        return "dependent" not in names

    await eventually(dependent_gone, "the garbage collector to delete the dependent ConfigMap")

    await create(k8s_api, k8s_namespace, deployment("owned", replicas=2, gpus=1))
    await eventually(lambda: _count(core, k8s_namespace, "app=owned", 2), "the Deployment's pods", within=30)
    await apps.delete_namespaced_deployment("owned", k8s_namespace, propagation_policy="Background")

    async def cascade_done() -> bool:
        sets = (await apps.list_namespaced_replica_set(k8s_namespace, label_selector="app=owned")).items
        return not sets and await _count(core, k8s_namespace, "app=owned", 0)

    await eventually(cascade_done, "the ReplicaSet and pods to be collected")


async def _count(core: client.CoreV1Api, namespace: str, selector: str, expected: int) -> bool:
    return len(await pods_of(core, namespace, selector)) == expected


async def test_helm_installs_and_uninstalls_a_chart(
    k8s_cluster: DevCluster, k8s_api: client.ApiClient, k8s_namespace: str
) -> None:
    apps, core = client.AppsV1Api(k8s_api), client.CoreV1Api(k8s_api)
    ns = ["--namespace", k8s_namespace]
    await run_tool(k8s_cluster, "helm", "lint", str(TINY_CHART))
    await run_tool(
        k8s_cluster,
        "helm",
        "install",
        "tiny",
        str(TINY_CHART),
        *ns,
        "--set",
        "replicas=2",
        "--wait",
        "--timeout",
        "90s",
    )
    releases = json.loads((await run_tool(k8s_cluster, "helm", "list", *ns, "-o", "json"))[1])
    assert [(r["name"], r["status"]) for r in releases] == [("tiny", "deployed")]
    dep = await apps.read_namespaced_deployment("tiny-app", k8s_namespace)
    assert dep.status.ready_replicas == 2
    assert (await core.read_namespaced_config_map("tiny-config", k8s_namespace)).data == {"greeting": "hello"}

    await run_tool(k8s_cluster, "helm", "uninstall", "tiny", *ns, "--wait", "--timeout", "60s")
    assert json.loads((await run_tool(k8s_cluster, "helm", "list", *ns, "-o", "json"))[1]) == []
    selector = "app.kubernetes.io/instance=tiny"
    assert not (await apps.list_namespaced_deployment(k8s_namespace, label_selector=selector)).items
    assert not (await core.list_namespaced_config_map(k8s_namespace, label_selector=selector)).items
    assert not (await core.list_namespaced_service(k8s_namespace, label_selector=selector)).items
    await eventually(lambda: _count(core, k8s_namespace, selector, 0), "the release's pods to go")


async def test_limited_service_account_is_denied_what_its_role_does_not_grant(
    k8s_cluster: DevCluster, k8s_api: client.ApiClient, k8s_namespace: str
) -> None:
    core = client.CoreV1Api(k8s_api)
    await create(k8s_api, k8s_namespace, {"apiVersion": "v1", "kind": "ServiceAccount", "metadata": {"name": "reader"}})
    role = {
        "apiVersion": "rbac.authorization.k8s.io/v1",
        "kind": "Role",
        "metadata": {"name": "pod-reader"},
        "rules": [{"apiGroups": [""], "resources": ["pods"], "verbs": ["get", "list", "watch"]}],
    }
    await create(k8s_api, k8s_namespace, role)
    binding = {
        "apiVersion": "rbac.authorization.k8s.io/v1",
        "kind": "RoleBinding",
        "metadata": {"name": "reader-reads-pods"},
        "roleRef": {"apiGroup": "rbac.authorization.k8s.io", "kind": "Role", "name": "pod-reader"},
        "subjects": [{"kind": "ServiceAccount", "name": "reader", "namespace": k8s_namespace}],
    }
    await create(k8s_api, k8s_namespace, binding)
    request = client.AuthenticationV1TokenRequest(
        spec=client.V1TokenRequestSpec(audiences=[SERVICE_ACCOUNT_ISSUER], expiration_seconds=600)
    )
    token = await core.create_namespaced_service_account_token("reader", k8s_namespace, request)
    kubeconfig = k8s_cluster.token_kubeconfig(f"{k8s_namespace}-reader", token.status.token, k8s_namespace)

    limited = await kube_config.new_client_from_config(config_file=str(kubeconfig))
    try:
        as_reader = client.CoreV1Api(limited)
        assert (await as_reader.list_namespaced_pod(k8s_namespace)).items == []
        denied: list[Callable[[], Awaitable[object]]] = [
            lambda: as_reader.list_namespaced_secret(k8s_namespace),
            lambda: as_reader.create_namespaced_config_map(
                k8s_namespace, client.V1ConfigMap(metadata=client.V1ObjectMeta(name="x"))
            ),
            lambda: as_reader.list_namespaced_pod("default"),
            lambda: as_reader.delete_namespaced_pod("anything", k8s_namespace),
        ]
        for call in denied:
            with pytest.raises(client.ApiException) as err:
                await call()
            assert err.value.status == 403
            assert f"system:serviceaccount:{k8s_namespace}:reader" in str(err.value.body)
    finally:
        await limited.close()

    # A client-certificate user with no bindings at all: authenticated, and denied everything.
    stranger = k8s_cluster.mint_user("stranger", ("tandem:testers",), namespace=k8s_namespace)
    answer = await run_tool(k8s_cluster, "kubectl", "auth", "can-i", "list", "pods", kubeconfig=stranger, check=False)
    assert answer == (1, "no\n")
    _, whoami_json = await run_tool(k8s_cluster, "kubectl", "auth", "whoami", "-o", "json", kubeconfig=stranger)
    whoami = json.loads(whoami_json)
    assert whoami["status"]["userInfo"]["username"] == "stranger"
    assert "tandem:testers" in whoami["status"]["userInfo"]["groups"]
