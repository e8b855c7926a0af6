"""Pure parts of the dev cluster: node manifests, command lines, kubeconfigs, certificates, pod-runner decisions."""

from __future__ import annotations

import ipaddress
import re
import subprocess
from pathlib import Path
from typing import Any

import pytest
from pydantic import ValidationError

from tandem_dev.devcluster import components, pki
from tandem_dev.devcluster.cluster import STAGES, fleet_progress
from tandem_dev.devcluster.config import K8S_VERSION, DevClusterConfig, MissingBinariesError, require_binaries
from tandem_dev.devcluster.kubeconfig import kubeconfig
from tandem_dev.devcluster.nodes import BLOCK_LABEL, GPU_RESOURCE, KWOK_ANNOTATION, RDMA_RESOURCE, fake_nodes
from tandem_dev.devcluster.podrunner import (
    Launch,
    NotAnSGLangCommandError,
    SimulateRule,
    container_env,
    desired_launches,
    expand,
    resolve_services,
    service_refs,
    sglang_server_args,
)
from tandem_dev.devcluster.services import resolve_urls, selected_pod_ip, url_service_refs


def test_fake_nodes_have_gpus_rdma_blocks_and_loopback_addresses() -> None:
    nodes = fake_nodes(DevClusterConfig(nodes=6, nodes_per_block=4))
    assert [n["metadata"]["name"] for n in nodes] == [f"gpu-node-00{i}" for i in range(6)]
    assert [n["metadata"]["labels"][BLOCK_LABEL] for n in nodes] == ["block-0"] * 4 + ["block-1"] * 2
    for node in nodes:
        assert node["status"]["capacity"][GPU_RESOURCE] == "8"
        assert node["status"]["allocatable"][RDMA_RESOURCE] == "1"
        assert node["metadata"]["annotations"][KWOK_ANNOTATION[0]] == KWOK_ANNOTATION[1]
        address = node["status"]["addresses"][0]["address"]
        assert ipaddress.ip_address(address).is_loopback
    assert len({n["status"]["addresses"][0]["address"] for n in nodes}) == 6


def test_config_rejects_pod_ips_off_loopback() -> None:
    with pytest.raises(ValidationError, match=r"pod_cidr 10\.1\.0\.0/16 must lie inside 127\.0\.0\.0/8"):
        DevClusterConfig(pod_cidr="10.1.0.0/16")
    with pytest.raises(ValidationError, match="nodes"):
        DevClusterConfig(nodes=0)


def test_every_component_listens_on_loopback_only(tmp_path: Path) -> None:
    layout = components.Layout(tmp_path, components.Ports(2379, 2380, 6443, 10257, 10259))
    config = DevClusterConfig()
    argvs = [
        components.etcd_argv(Path("etcd"), layout),
        components.apiserver_argv(Path("kube-apiserver"), layout, config),
        components.controller_manager_argv(Path("kcm"), layout, config),
        components.scheduler_argv(Path("kube-scheduler"), layout),
        components.kwok_argv(Path("kwok"), layout, config, Path("stages.yaml")),
    ]
    for argv in argvs:
        for arg in argv:
            assert "=0.0.0.0" not in arg, arg
            assert "//0.0.0.0" not in arg, arg
            if "address=" in arg or "urls=" in arg:
                assert "127.0.0.1" in arg, arg
    assert "--authorization-mode=RBAC" in argvs[1]
    assert "--cidr=127.10.0.1/16" in argvs[4]


def test_kwok_leaves_probed_pods_not_ready_unless_nothing_runs_behind_pods() -> None:
    template = STAGES.read_text()
    assert components.kwok_stages(template, DevClusterConfig()) == template
    marked = components.kwok_stages(template, DevClusterConfig(kwok_marks_ready=True))
    assert "{{ $probeReadiness := false }}" in marked
    assert "$probeReadiness := true" not in marked
    with pytest.raises(ValueError, match="switch"):
        components.kwok_stages("stages without the switch", DevClusterConfig())


def test_python_side_pins_the_version_the_go_module_builds() -> None:
    go_mod = (Path(__file__).resolve().parents[3] / "k8s" / "tools" / "go.mod").read_text()
    pins = re.findall(r"^\s*k8s\.io/kubernetes (v\S+)", go_mod, re.MULTILINE)
    assert pins == [K8S_VERSION]


def test_missing_binaries_name_the_build_script(tmp_path: Path) -> None:
    with pytest.raises(MissingBinariesError, match=r"kube-apiserver.*scripts/build-k8s.sh"):
        require_binaries(tmp_path)


def test_kubeconfig_needs_exactly_one_credential(tmp_path: Path) -> None:
    ca = tmp_path / "ca.crt"
    doc = kubeconfig("https://127.0.0.1:6443", ca, "bob", token="t0k")
    assert doc["users"] == [{"name": "bob", "user": {"token": "t0k"}}]
    assert doc["current-context"] == "bob"
    with pytest.raises(ValueError, match="either client_cert and client_key, or token"):
        kubeconfig("https://127.0.0.1:6443", ca, "bob")
    with pytest.raises(ValueError, match="either"):
        kubeconfig("https://127.0.0.1:6443", ca, "bob", token="t", client_cert=ca, client_key=ca)


def test_client_certificates_carry_user_and_groups(tmp_path: Path) -> None:
    ca = pki.create_ca(tmp_path)
    cert = pki.issue_client_cert(ca, tmp_path, "alice", ("team:a", "system:authenticated"))
    verify = subprocess.run(
        ["openssl", "verify", "-CAfile", str(ca.cert), str(cert.cert)], capture_output=True, text=True, check=False
    )
    assert verify.returncode == 0, verify.stderr
    text = subprocess.run(
        ["openssl", "x509", "-in", str(cert.cert), "-noout", "-subject"], capture_output=True, text=True, check=True
    ).stdout
    assert "O = team:a, O = system:authenticated, CN = alice" in text
    with pytest.raises(ValueError, match="invalid certificate subject part 'a/b'"):
        pki.issue_client_cert(ca, tmp_path, "a/b")


def _pod(**overrides: Any) -> dict[str, Any]:
    pod: dict[str, Any] = {
        "metadata": {"name": "decode-0", "namespace": "ns", "uid": "uid-1", "labels": {}},
        "spec": {
            "nodeName": "gpu-node-001",
            "containers": [
                {
                    "name": "sglang",
                    "image": "lmsysorg/sglang:v0.5.23",
                    "command": ["python3", "-m", "sglang.launch_server"],
                    "args": ["--model-path", "/m", "--host", "$(POD_IP)", "--port", "30001"],
                    "env": [
                        {"name": "MC_MIN_RPC_PORT", "value": "15000"},
                        {"name": "POD_IP", "valueFrom": {"fieldRef": {"fieldPath": "status.podIP"}}},
                        {"name": "TOKEN", "valueFrom": {"secretKeyRef": {"name": "s", "key": "k"}}},
                        {"name": "BIND", "value": "$(POD_IP):$(MC_MIN_RPC_PORT)"},
                    ],
                }
            ],
        },
        "status": {"phase": "Running", "podIP": "127.10.0.7"},
    }
    for key, value in overrides.items():
        pod[key] = value
    return pod


def test_server_args_pass_through_unchanged_in_every_spelling() -> None:
    argv = ["python3", "-m", "sglang.launch_server", "--host=::", "--tp", "8"]
    assert sglang_server_args(argv) == ("--host=::", "--tp", "8")
    shell = ["bash", "-c", "exec python3 -m sglang.launch_server --port 31000 --host 0.0.0.0 --trust-remote-code"]
    assert sglang_server_args(shell) == ("--port", "31000", "--host", "0.0.0.0", "--trust-remote-code")
    with pytest.raises(NotAnSGLangCommandError, match=r"does not run python3 -m sglang\.launch_server"):
        sglang_server_args(["nginx", "-g", "daemon off;"])


def test_var_references_expand_as_the_kubelet_expands_them() -> None:
    env = {"POD_IP": "127.10.0.7", "PORT": "30001"}
    assert expand("--host=$(POD_IP)", env) == "--host=127.10.0.7"
    assert expand("$(POD_IP):$(PORT)", env) == "127.10.0.7:30001"
    assert expand("$(UNDEFINED) $$(POD_IP) $$ $", env) == "$(UNDEFINED) $(POD_IP) $ $"


def test_env_resolves_literals_and_downward_api_fields() -> None:
    pod = _pod()
    env = dict(container_env(pod, pod["spec"]["containers"][0]))
    assert env == {"MC_MIN_RPC_PORT": "15000", "POD_IP": "127.10.0.7", "BIND": "127.10.0.7:15000"}


def test_desired_launches_only_for_running_matching_pods() -> None:
    launches = desired_launches([_pod()], SimulateRule())
    assert list(launches) == ["uid-1"]
    launch = launches["uid-1"]
    assert launch == Launch(
        pod="ns/decode-0",
        uid="uid-1",
        host="127.10.0.7",
        server_args=("--model-path", "/m", "--host", "127.10.0.7", "--port", "30001"),
        env=(("MC_MIN_RPC_PORT", "15000"), ("POD_IP", "127.10.0.7"), ("BIND", "127.10.0.7:15000")),
    )
    assert launch.port == 30001
    pending = _pod(status={"phase": "Pending"})
    deleting = _pod(metadata={"name": "d", "namespace": "ns", "uid": "u2", "deletionTimestamp": "2026-01-01T00:00:00Z"})
    assert desired_launches([pending, deleting], SimulateRule()) == {}
    other = _pod()
    other["spec"]["containers"][0]["image"] = "registry.invalid/worker:1"
    assert desired_launches([other], SimulateRule()) == {}
    other["metadata"]["labels"] = {"tandem.dev/simulate": "true"}
    assert list(desired_launches([other], SimulateRule())) == ["uid-1"]


def test_dev_cluster_command_rejects_bad_options_by_name(capsys: pytest.CaptureFixture[str]) -> None:
    from tandem.cli import main

    assert main(["dev-cluster", "--nodes", "0"]) == 2
    assert "invalid option" in capsys.readouterr().err
    assert main(["dev-cluster", "--pod-cidr", "10.0.0.0/8"]) == 2
    assert "pod_cidr 10.0.0.0/8 must lie inside 127.0.0.0/8" in capsys.readouterr().err


def test_service_names_in_address_flags_resolve_to_the_selected_pod_ip() -> None:
    args = ("--dist-init-addr", "kimi-decode-0.ns.svc:5001", "--node-rank", "1", "--host", "127.10.0.8")
    launch = Launch(pod="ns/kimi-decode-0-1", uid="u", host="127.10.0.8", server_args=args)
    assert service_refs(launch) == {("ns", "kimi-decode-0")}
    leader = _pod(metadata={"name": "kimi-decode-0-0", "namespace": "ns", "uid": "l", "labels": {"g": "0", "r": "0"}})
    other = _pod(metadata={"name": "x", "namespace": "other", "uid": "o", "labels": {"g": "0", "r": "0"}})
    assert selected_pod_ip([other, leader], "ns", {"g": "0", "r": "0"}) == "127.10.0.7"
    assert selected_pod_ip([other, leader], "ns", {"g": "1"}) is None
    resolved = resolve_services(launch, {("ns", "kimi-decode-0"): "127.10.0.7"})
    assert resolved is not None
    assert resolved.server_args[:2] == ("--dist-init-addr", "127.10.0.7:5001")
    assert resolve_services(launch, {}) is None  # waits for the leader
    plain = Launch(pod="ns/p", uid="p", host="127.10.0.9", server_args=("--dist-init-addr", "127.0.0.1:5000"))
    assert service_refs(plain) == set()
    assert resolve_services(plain, {}) == plain


def test_service_hosts_in_a_hooks_urls_resolve_to_the_selected_pod_ip() -> None:
    hook = ["python3", "-c", "...", "http://kimi-decode-0.ns.svc:30001/ready", "http://kimi-decode-0.ns.svc:30001/m"]
    assert url_service_refs(hook) == {("ns", "kimi-decode-0")}
    assert resolve_urls(hook, {("ns", "kimi-decode-0"): "127.10.0.7"})[3:] == [
        "http://127.10.0.7:30001/ready",
        "http://127.10.0.7:30001/m",
    ]
    assert resolve_urls(hook, {}) == hook  # unknown: left to fail as an unresolvable name
    assert url_service_refs(["http://127.0.0.1:80/x", "kimi.ns.svc"]) == set()  # only hosts of URLs


def test_large_fleets_renew_node_leases_less_often_and_the_node_monitor_waits_longer(tmp_path: Path) -> None:
    layout = components.Layout(tmp_path, components.Ports(2379, 2380, 6443, 10257, 10259))
    small, large = DevClusterConfig(nodes=8), DevClusterConfig(nodes=1000)
    assert (small.node_lease_seconds, small.node_monitor_grace_seconds) == (40, 50)  # the kubelet's defaults
    assert large.node_lease_seconds == 200  # 1,000 leases renewed every 50 s: 20 renewals/s
    assert large.start_timeout_seconds > small.start_timeout_seconds
    kwok = components.kwok_argv(Path("kwok"), layout, large, Path("stages.yaml"))
    kcm = components.controller_manager_argv(Path("kcm"), layout, large)
    assert "--node-lease-duration-seconds=200" in kwok
    assert "--node-monitor-grace-period=210s" in kcm
    assert "--kube-api-qps=200" in kcm
    assert "--kube-api-qps=200" in components.scheduler_argv(Path("kube-scheduler"), layout)


def test_the_controller_manager_runs_every_default_controller_tandem_relies_on(tmp_path: Path) -> None:
    layout = components.Layout(tmp_path, components.Ports(2379, 2380, 6443, 10257, 10259))
    kcm = components.controller_manager_argv(Path("kcm"), layout, DevClusterConfig())
    [controllers] = [arg.removeprefix("--controllers=").split(",") for arg in kcm if arg.startswith("--controllers=")]
    assert controllers[0] == "*"
    off = {name.removeprefix("-") for name in controllers[1:]}
    assert all(name.startswith("-") for name in controllers[1:])
    assert "endpointslice-controller" in off
    # Owners (pods of a PDPool), namespaces, service accounts, lost nodes, the chart's workloads and claims:
    needed = {"garbage-collector-controller", "namespace-controller", "serviceaccount-controller"}
    needed |= {"serviceaccount-token-controller", "node-lifecycle-controller", "taint-eviction-controller"}
    needed |= {"pod-garbage-collector-controller", "deployment-controller", "replicaset-controller"}
    needed |= {"statefulset-controller", "job-controller", "horizontal-pod-autoscaler-controller"}
    needed |= {"persistentvolume-binder-controller", "persistentvolumeclaim-protection-controller"}
    assert not off & needed


def test_fleet_progress_counts_registered_ready_and_untainted_nodes() -> None:
    ready = {"type": "Ready", "status": "True"}
    nodes: list[dict[str, Any]] = [
        {"status": {}},
        {"status": {"conditions": [ready]}, "spec": {"taints": [{"effect": "NoSchedule", "key": "not-ready"}]}},
        {"status": {"conditions": [ready]}},
    ]
    assert fleet_progress(nodes) == (3, 2, 1)
