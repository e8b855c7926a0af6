"""``tandem operator`` from the built image, configured as in a pod: no kubeconfig, only a ServiceAccount token,
the cluster CA and the namespace at the in-cluster paths plus KUBERNETES_SERVICE_HOST/PORT; it reconciles a small
PDCluster on the dev cluster until it is Ready (kwok nodes). The account is bound to cluster-admin here: the
chart's own RBAC is tested by the chart tests, not by this smoke test.
"""

from __future__ import annotations

import uuid
from pathlib import Path
from urllib.parse import urlsplit

import pytest
from kubernetes_asyncio import client

from tandem_dev.devcluster.cluster import DevCluster
from tandem_dev.images.run import Unpacked, container_argv
from tandem_dev.procs import ManagedProcess
from tests.operator.live import create_pdcluster, pdcluster, pods, ready
from tests.plumbing.imagehelpers import UID, process_ids, tandem_image
from tests.tandem_dev.devcluster.devcluster_fixtures import eventually

pytestmark = [pytest.mark.k8s, pytest.mark.netns, pytest.mark.timeout(240)]
__all__ = ["tandem_image"]
SERVICE_ACCOUNT_DIR = "/var/run/secrets/kubernetes.io/serviceaccount"


async def _service_account(api: client.ApiClient, namespace: str, into: Path, ca: Path) -> Path:
    """What the kubelet mounts for a pod of ``namespace/tandem-operator``: token, ca.crt, namespace."""
    core, rbac = client.CoreV1Api(api), client.RbacAuthorizationV1Api(api)
    meta = client.V1ObjectMeta(name="tandem-operator")
    await core.create_namespaced_service_account(namespace, client.V1ServiceAccount(metadata=meta))
    binding = client.V1ClusterRoleBinding(
        metadata=client.V1ObjectMeta(name=f"image-smoke-{uuid.uuid4().hex[:8]}"),
        role_ref=client.V1RoleRef(api_group="rbac.authorization.k8s.io", kind="ClusterRole", name="cluster-admin"),
        subjects=[client.RbacV1Subject(kind="ServiceAccount", name="tandem-operator", namespace=namespace)],
    )
    await rbac.create_cluster_role_binding(binding)
    spec = client.V1TokenRequestSpec(audiences=[], expiration_seconds=3600)
    request = client.AuthenticationV1TokenRequest(spec=spec)
    token = await core.create_namespaced_service_account_token("tandem-operator", namespace, request)
    return _write_volume(into, ca, {"token": token.status.token, "namespace": namespace})


def _write_volume(into: Path, ca: Path, files: dict[str, str]) -> Path:
    into.mkdir()
    files = {**files, "ca.crt": ca.read_text()}
    for name, text in files.items():
        (into / name).write_text(text)
        (into / name).chmod(0o644)  # readable by uid 65532, as the kubelet's projected volume
    return into


@pytest.mark.usefixtures("tandem_crds", "health_pods")  # pods Ready only via their readinessProbe
async def test_the_operator_from_the_image_reconciles_a_pdcluster_with_in_cluster_config(
    tandem_image: Unpacked,
    k8s_cluster: DevCluster,
    k8s_api: client.ApiClient,
    k8s_namespace: str,
    etcd_endpoint: str,
    tmp_path: Path,
) -> None:
    ns = k8s_namespace
    secrets = await _service_account(k8s_api, ns, tmp_path / "serviceaccount", k8s_cluster.ca_cert)
    server = urlsplit(k8s_cluster.server)
    env = {"KUBERNETES_SERVICE_HOST": str(server.hostname), "KUBERNETES_SERVICE_PORT": str(server.port)}
    args = ["operator", "--namespace", ns, "--etcd-endpoints", etcd_endpoint, "--resync", "5"]
    argv = container_argv(tandem_image, args, env=env, volumes={secrets: SERVICE_ACCOUNT_DIR})
    operator = ManagedProcess("operator-image", argv, tmp_path / "operator.log").start()
    try:
        await create_pdcluster(k8s_api, ns, pdcluster("img"))
        await eventually(lambda: ready(k8s_api, ns, "img", 1, 1), "PDCluster img Ready", within=120)
        assert sorted(p.metadata.name for p in await pods(k8s_api, ns)) == [
            "img-decode-0-0",
            "img-decode-0-1",
            "img-prefill-0-0",
        ]
        assert process_ids(operator.pid)[:2] == (UID, UID)
        assert operator.alive(), operator.log_tail()
    finally:
        operator.stop()
