"""What a dev cluster looks like: one pydantic model, plus where the binaries live.

The binaries are built by ``scripts/build-k8s.sh`` into ``~/.cache/tandem/k8s/<K8S_VERSION>/bin``;
``K8S_VERSION`` must match the ``k8s.io/kubernetes`` pin in ``k8s/tools/go.mod`` (a test checks this).
"""

from __future__ import annotations

import ipaddress
import os
from pathlib import Path

from pydantic import BaseModel, ConfigDict, Field, field_validator

K8S_VERSION = "v1.34.4"
BINARIES = ("etcd", "kube-apiserver", "kube-controller-manager", "kube-scheduler", "kwok", "kubectl", "helm")
LOOPBACK = ipaddress.ip_network("127.0.0.0/8")
KUBELET_LEASE_SECONDS = 40  # the kubelet's default nodeLeaseDurationSeconds
LEASE_RENEWALS_PER_S = 20  # node Lease renewals per second kwok may send, at most, beyond 200 nodes


class MissingBinariesError(RuntimeError):
    """The control-plane binaries have not been built yet."""


class DevClusterConfig(BaseModel):
    """Shape of the fake GPU fleet and the loopback address ranges the cluster uses."""

    model_config = ConfigDict(frozen=True, extra="forbid")

    nodes: int = Field(default=8, ge=1, le=5000, description="fake GPU nodes managed by kwok")
    gpus_per_node: int = Field(default=8, ge=0, description="nvidia.com/gpu capacity of each node")
    rdma_per_node: int = Field(default=1, ge=0, description="rdma/ib capacity of each node")
    nodes_per_block: int = Field(default=4, ge=1, description="nodes sharing one topology.tandem.dev/block value")
    gpu_product: str = Field(default="NVIDIA-H200", description="nvidia.com/gpu.product label")
    pod_cidr: str = Field(
        default="127.10.0.0/16", description="pod IPs (127/8, routed on the pod bridge of the cluster's own netns)"
    )
    node_ip_base: str = Field(default="127.9.0.1", description="first node InternalIP (loopback)")
    service_cidr: str = Field(default="10.0.0.0/24", description="ClusterIPs (never routed; nothing proxies them)")
    kwok_marks_ready: bool = Field(
        default=False,
        description="kwok marks pods Ready without their readinessProbe: only where nothing runs behind pods "
        "(the operator benchmark); otherwise the pod runner's probe decides. Such a cluster makes no pod network "
        "(no bridge), so it can run beside another dev cluster in the same namespace",
    )

    @property
    def node_lease_seconds(self) -> int:
        """kwok's ``--node-lease-duration-seconds``; it renews each node's Lease every quarter of it. 40 s (the
        kubelet's default) up to 200 nodes; above, it grows with the fleet so the renewals stay at
        ``LEASE_RENEWALS_PER_S`` (1,000 nodes at 40 s would PUT 100 Leases/s on two shared cores)."""
        return max(KUBELET_LEASE_SECONDS, 4 * self.nodes // LEASE_RENEWALS_PER_S)

    @property
    def node_monitor_grace_seconds(self) -> int:
        """kube-controller-manager's ``--node-monitor-grace-period``: a node whose Lease is older is NotReady. The
        default (50 s) is the kubelet's 40 s Lease plus 10 s; a longer Lease needs the same margin."""
        return self.node_lease_seconds + 10

    @property
    def start_timeout_seconds(self) -> float:
        """How long ``DevCluster.start`` waits by default: two minutes plus 0.3 s a node (1,000 nodes: 7 min)."""
        return 120.0 + 0.3 * self.nodes

    @field_validator("pod_cidr")
    @classmethod
    def _pod_cidr_on_loopback(cls, value: str) -> str:
        net = ipaddress.ip_network(value, strict=True)
        if not net.subnet_of(LOOPBACK):  # type: ignore[arg-type]
            raise ValueError(f"pod_cidr {value} must lie inside {LOOPBACK} so processes can bind pod IPs")
        return value

    @field_validator("node_ip_base")
    @classmethod
    def _node_ip_on_loopback(cls, value: str) -> str:
        if ipaddress.ip_address(value) not in LOOPBACK:
            raise ValueError(f"node_ip_base {value} must lie inside {LOOPBACK}")
        return value

    @field_validator("service_cidr")
    @classmethod
    def _valid_service_cidr(cls, value: str) -> str:
        ipaddress.ip_network(value, strict=True)
        return value


def default_bin_dir() -> Path:
    """``$TANDEM_K8S_BIN``, else the build script's cache for ``K8S_VERSION``."""
    override = os.environ.get("TANDEM_K8S_BIN")
    if override:
        return Path(override)
    root = Path(os.environ.get("TANDEM_K8S_CACHE", Path.home() / ".cache" / "tandem" / "k8s"))
    return root / K8S_VERSION / "bin"


def require_binaries(bin_dir: Path) -> dict[str, Path]:
    """Map each binary name to its path; raise with the build command when any is missing."""
    paths = {name: bin_dir / name for name in BINARIES}
    missing = [name for name, path in paths.items() if not os.access(path, os.X_OK)]
    if missing:
        raise MissingBinariesError(
            f"missing Kubernetes binaries in {bin_dir}: {', '.join(missing)}; build them with scripts/build-k8s.sh"
        )
    return paths
