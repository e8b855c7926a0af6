"""Worker pod bodies as the API server returns them, built from the operator's own desired manifests."""

from __future__ import annotations

from typing import Any

from tandem.registry import Role
from tandem_operator.api.pdcluster import PDClusterSpec
from tandem_operator.decide.recovery import stamp_epoch
from tandem_operator.desired.naming import ClusterRef, OwnerRef
from tandem_operator.desired.pods import RoleContext, group_pod

CLUSTER = ClusterRef(name="kimi", namespace="serving", uid="uid-1")
POOL = OwnerRef("tandem.dev/v1alpha1", "PDPool", "kimi-decode", "uid-2")


def live_pod(
    spec: PDClusterSpec,
    role: Role,
    group: int,
    rank: int,
    *,
    epoch: int = 0,
    ip: str | None = "10.0.0.1",
    ready: bool = True,
    node: str = "gpu-1",
) -> dict[str, Any]:
    pod = stamp_epoch(group_pod(RoleContext.build(CLUSTER, spec, role, POOL), group, rank, epoch), epoch)
    pod["spec"]["nodeName"] = node
    pod["status"] = {
        "phase": "Running",
        "conditions": [{"type": "Ready", "status": "True" if ready else "False"}],
        **({"podIP": ip} if ip else {}),
    }
    return pod
