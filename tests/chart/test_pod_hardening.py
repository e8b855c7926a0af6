"""Every pod the chart renders (workloads, hooks, helm tests, with every values file and optional component) runs
non-root with RuntimeDefault seccomp, no privilege escalation, a read-only root filesystem, no capabilities, and
requests CPU and memory."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest

from tests.chart.render import VALUES_FILES, pod_templates, render

OPTIONAL = [
    "--set", "mooncakeMaster.enabled=true", "--set", "mooncakeMaster.etcdEndpoints={mooncake-etcd:2379}",
    "--set", "router.hpa.enabled=true",
    "--set", "etcd.persistence.enabled=false", "--set", "metrics.serviceMonitor.enabled=true",
]  # fmt: skip


def rendered_pods(values: Path | None) -> dict[str, dict[str, Any]]:
    args = [*OPTIONAL] if values is None else ["-f", str(values)]
    return pod_templates(render(*args))


def hardening_faults(name: str, pod: dict[str, Any]) -> list[str]:
    spec, faults = pod["spec"], []
    security = spec.get("securityContext", {})
    if security.get("runAsNonRoot") is not True:
        faults.append(f"{name}: runAsNonRoot is not true")
    if security.get("seccompProfile") != {"type": "RuntimeDefault"}:
        faults.append(f"{name}: seccompProfile is not RuntimeDefault")
    for field in ("hostNetwork", "hostPID", "hostIPC"):
        if spec.get(field):
            faults.append(f"{name}: {field}")
    for c in [*spec.get("initContainers", []), *spec["containers"]]:
        where, sc = f"{name}/{c['name']}", c.get("securityContext", {})
        if sc.get("allowPrivilegeEscalation") is not False:
            faults.append(f"{where}: allowPrivilegeEscalation is not false")
        if sc.get("readOnlyRootFilesystem") is not True:
            faults.append(f"{where}: readOnlyRootFilesystem is not true")
        if sc.get("capabilities") != {"drop": ["ALL"]}:
            faults.append(f"{where}: capabilities are not exactly drop [ALL]: {sc.get('capabilities')}")
        if sc.get("privileged"):
            faults.append(f"{where}: privileged")
        requests = c.get("resources", {}).get("requests", {})
        if not {"cpu", "memory"} <= set(requests):
            faults.append(f"{where}: requests {requests} lack cpu or memory")
    return faults


@pytest.mark.parametrize("values", [None, *VALUES_FILES], ids=lambda p: "all-components" if p is None else p.name)
def test_every_rendered_pod_is_hardened(values: Path | None) -> None:
    pods = rendered_pods(values)
    assert pods
    faults = [fault for name, pod in pods.items() for fault in hardening_faults(name, pod)]
    assert not faults, "\n".join(faults)


def test_the_check_covers_every_component_and_finds_faults() -> None:
    pods = rendered_pods(None)
    components = {p["metadata"]["labels"]["app.kubernetes.io/component"] for p in pods.values()}
    assert components == {"operator", "router", "etcd", "etcd-auth", "mooncake-master", "helm-test"}
    loose = {"spec": {"containers": [{"name": "c", "securityContext": {"capabilities": {"add": ["NET_ADMIN"]}}}]}}
    assert len(hardening_faults("loose", loose)) == 6


def test_read_only_pods_have_a_writable_tmp_where_they_write() -> None:
    """The Mooncake master's glog writes log files under /tmp if it logs to files: an emptyDir there, bounded.
    (Measured with the 0.3.13 wheel run as uid 65532: it logged to stderr and opened no file for writing.)"""
    [master] = [p for k, p in rendered_pods(None).items() if k.endswith("-mooncake-master")]
    mounts = {m["mountPath"]: m["name"] for m in master["spec"]["containers"][0]["volumeMounts"]}
    volumes = {v["name"]: v for v in master["spec"]["volumes"]}
    assert volumes[mounts["/tmp"]]["emptyDir"]["sizeLimit"]
