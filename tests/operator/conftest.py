"""Shared builders for the operator's pure-function tests, and fixtures of its live tests."""

from __future__ import annotations

import asyncio
import sys
from collections.abc import AsyncIterator, Iterator
from pathlib import Path
from typing import TYPE_CHECKING, Any

import pytest
import pytest_asyncio

from tandem.registry import Role
from tandem_dev.devcluster.cluster import DevCluster
from tandem_dev.procs import ManagedProcess, free_port
from tandem_operator.api.pdcluster import PDClusterSpec
from tandem_operator.desired.drain_hook import DRAIN_GAUGES
from tandem_operator.desired.naming import ClusterRef, OwnerRef
from tandem_operator.desired.pods import RoleContext

if TYPE_CHECKING:  # the live fixtures import them where used: the pure tests here need none (~1 s of CPU)
    from kubernetes_asyncio import client

    from tandem_dev.devcluster.podrunner import Launch, PodRunner
    from tests.operator.live import Live

KIMI_8XH200: dict[str, Any] = {
    "transfer": {"protocol": "rdma", "ibDevices": ["mlx5_0", "mlx5_1"]},
    "etcd": {"endpoints": ["http://etcd-0.etcd:2379", "http://etcd-1.etcd:2379"]},
    "prefill": {"groups": 2, "chunkedPrefillSize": 524288, "enableEplb": True, "topologyKey": "example.com/rack"},
    "decode": {
        "groups": 1,
        "nodesPerGroup": 2,
        "tpSize": 16,
        "epSize": 16,
        "attnDpSize": 16,
        "enableDpLmHead": True,
        "moeDenseTpSize": 1,
        "topologyKey": "example.com/rack",
        "nodeSelector": {"nvidia.com/gpu.product": "NVIDIA-H200"},
        "tolerations": [{"key": "nvidia.com/gpu", "operator": "Exists", "effect": "NoSchedule"}],
        "resources": {"requests": {"cpu": 96, "memory": "1500Gi"}},
        "env": [{"name": "SGLANG_DISAGGREGATION_HEARTBEAT_INTERVAL", "value": "2"}],
        "kvOffload": {"enabled": True, "storageBackend": "mooncake", "mooncakeStore": {}},
    },
}


def kimi_spec(**overrides: Any) -> PDClusterSpec:
    return PDClusterSpec.model_validate({**KIMI_8XH200, **overrides})


def role_hash(spec: PDClusterSpec, role: Role) -> str:
    """The role's template hash (revision of its pods as rendered) for a PDCluster ``c`` in ``ns``."""
    owner = OwnerRef("tandem.dev/v1alpha1", "PDPool", f"c-{role.value}", "uid")
    return RoleContext.build(ClusterRef("c", "ns", "uid"), spec, role, owner).template_hash


@pytest.fixture(scope="session")
def etcd_endpoint(tmp_path_factory: pytest.TempPathFactory) -> Iterator[str]:
    """A real etcd (Debian etcd-server) on loopback for the registry and Mooncake metadata, one per session."""
    root = tmp_path_factory.mktemp("etcd")
    client, peer = free_port(), free_port()
    url = f"http://127.0.0.1:{client}"
    proc = ManagedProcess(
        "etcd",
        [
            "etcd",
            "--data-dir",
            str(root / "data"),
            "--listen-client-urls",
            url,
            "--advertise-client-urls",
            url,
            "--listen-peer-urls",
            f"http://127.0.0.1:{peer}",
            "--initial-advertise-peer-urls",
            f"http://127.0.0.1:{peer}",
            "--initial-cluster",
            f"default=http://127.0.0.1:{peer}",
        ],
        root / "etcd.log",
    ).start()
    try:
        proc.wait_http(f"{url}/health", timeout=20)
        yield url
    finally:
        proc.stop()


@pytest_asyncio.fixture(scope="session", loop_scope="session")
async def tandem_crds(k8s_cluster: DevCluster) -> None:
    """The generated CRDs applied once per session and Established."""
    from tests.operator.live import CRDS, run_tool

    await run_tool(k8s_cluster, "kubectl", "apply", "--server-side", "-f", str(CRDS))
    await asyncio.to_thread(k8s_cluster.wait_established, [path.stem for path in CRDS.glob("*.yaml")])


@pytest.fixture
async def runner(k8s_api: client.ApiClient, k8s_namespace: str, tmp_path: Path) -> AsyncIterator[PodRunner]:
    """The dev cluster's pod runner for the test's namespace: simulated workers behind its pods' IPs."""
    (tmp_path / "pods").mkdir()
    from tandem_dev.devcluster.podrunner import PodRunner

    async with PodRunner(k8s_api, tmp_path / "pods", namespace=k8s_namespace).running_in_background() as pod_runner:
        yield pod_runner


# Serves 200 on every GET at the pod's --port: enough for the readinessProbe (GET /health on "http").
HEALTH_ONLY = (
    "import http.server, sys\n"
    "IDLE = ''.join(f'# TYPE {g} gauge\\n{g} 0\\n' for g in sys.argv[2].split(',')).encode()\n"
    "class H(http.server.BaseHTTPRequestHandler):\n"
    "    def do_GET(self):\n"
    "        body = IDLE if self.path == '/metrics' else b''\n"
    "        self.send_response(200); self.end_headers(); self.wfile.write(body)\n"
    "    def log_message(self, *args): pass\n"
    "http.server.HTTPServer(('0.0.0.0', int(sys.argv[1])), H).serve_forever()\n"
)


def health_only(launch: Launch) -> list[str]:
    """An idle worker as the operator sees it: /health answers, /metrics reports nothing in flight (so a drain
    finishes as on an idle SGLang worker instead of waiting out its timeout for gauges it cannot read)."""
    return [sys.executable, "-c", HEALTH_ONLY, str(launch.port), ",".join(DRAIN_GAUGES)]


@pytest.fixture
async def health_pods(k8s_api: client.ApiClient, k8s_namespace: str, tmp_path: Path) -> AsyncIterator[PodRunner]:
    """Worker pods that pass their readinessProbe without a simulated worker, for tests of the operator alone.

    The dev cluster's pods are Ready only when their probe passes against a process behind the pod IP (the pod
    runner runs it); here that process answers the probe and nothing else.
    """
    from tandem_dev.devcluster.podrunner import PodRunner

    runner = PodRunner(k8s_api, tmp_path / "health-pods", launcher=health_only, namespace=k8s_namespace)
    async with runner.running_in_background():
        yield runner


@pytest.fixture
def live(
    k8s_cluster: DevCluster,
    k8s_api: client.ApiClient,
    k8s_namespace: str,
    tandem_crds: None,
    etcd_endpoint: str,
    tmp_path: Path,
    proc_factory: list[ManagedProcess],
) -> Live:
    """The dev cluster with Tandem's CRDs, a fresh namespace, the registry etcd, logs and processes of one test."""
    from tests.operator.live import Live

    return Live(k8s_cluster, k8s_api, k8s_namespace, etcd_endpoint, tmp_path, proc_factory)
