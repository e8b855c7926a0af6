"""Every pod the operator makes (each role, each rank, init containers) for the deploy/ examples and the transfer
variants: RuntimeDefault seccomp, every capability dropped but IPC_LOCK on the SGLang container, no privilege
escalation, CPU and memory requested; privileged only for host InfiniBand devices without a device plugin
(desired/security.py, operator/README.md "Worker pod hardening")."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
import yaml

from tandem.registry import Role
from tandem_operator.api.pdcluster import PDClusterSpec, TransferProtocol
from tandem_operator.desired.naming import ClusterRef, OwnerRef
from tandem_operator.desired.pods import RoleContext, group_manifests

DEPLOY = Path(__file__).resolve().parents[2] / "deploy"
RECIPE = yaml.safe_load((DEPLOY / "kimi-k26-h200.yaml").read_text())["spec"]
SPECS: dict[str, dict[str, Any]] = {
    "kimi-k26-h200": RECIPE,
    "kimi rdma device plugin": {**RECIPE, "transfer": {**RECIPE["transfer"], "rdmaResource": "rdma/ib"}},
    "kimi tcp pod network": {**RECIPE, "transfer": {**RECIPE["transfer"], "protocol": "tcp", "hostNetwork": False}},
    "sim-small": yaml.safe_load((DEPLOY / "sim-small.yaml").read_text())["spec"],
}


def pods(spec: PDClusterSpec) -> list[dict[str, Any]]:
    out = []
    for role in Role:
        owner = OwnerRef("tandem.dev/v1alpha1", "PDPool", f"c-{role.value}", "uid")
        ctx = RoleContext.build(ClusterRef("c", "ns", "uid"), spec, role, owner)
        out += [m for m in group_manifests(ctx, 0) if m["kind"] == "Pod"]
    return out


@pytest.mark.parametrize("name", SPECS)
def test_every_worker_pod_is_hardened(name: str) -> None:
    spec = PDClusterSpec.model_validate(SPECS[name])
    host_infiniband = spec.transfer.protocol is TransferProtocol.RDMA and spec.transfer.rdma_resource is None
    for pod in pods(spec):
        where = pod["metadata"]["name"]
        assert pod["spec"]["securityContext"] == {"seccompProfile": {"type": "RuntimeDefault"}}, where
        assert not {"hostPID", "hostIPC"} & set(pod["spec"]), where
        init = pod["spec"].get("initContainers", [])
        for c in [*init, *pod["spec"]["containers"]]:
            sc, requests = c["securityContext"], c["resources"]["requests"]
            assert {"cpu", "memory"} <= set(requests), (where, c["name"], requests)
            assert sc["capabilities"]["drop"] == ["ALL"], (where, c["name"])
            expected_add = ["IPC_LOCK"] if c in pod["spec"]["containers"] else None
            assert sc["capabilities"].get("add") == expected_add, (where, c["name"])
            privileged = host_infiniband and c in pod["spec"]["containers"]
            assert sc.get("privileged", False) is privileged, (where, c["name"])
            assert sc.get("allowPrivilegeEscalation") is (None if privileged else False), (where, c["name"])


def test_the_recipe_has_init_containers_to_check() -> None:
    """The K2.6 recipe prefetches weights in an init container, so the check above covers init containers."""
    assert all(pod["spec"]["initContainers"] for pod in pods(PDClusterSpec.model_validate(RECIPE)))
