"""The chart's NetworkPolicies, evaluated (tests/chart/netpol.py) against the pods the chart renders and the worker
pods the operator makes for a PDCluster: every flow Tandem needs is allowed, every other one checked is denied."""

from __future__ import annotations

import ipaddress
from dataclasses import replace
from pathlib import Path
from typing import Any

import pytest
import yaml

from tandem.registry import Role
from tandem_operator.api.pdcluster import PDClusterSpec
from tandem_operator.desired.naming import ClusterRef, OwnerRef
from tandem_operator.desired.pods import RoleContext, group_manifests
from tests.chart.netpol import Cluster, Pod, Source, network_policies
from tests.chart.render import CHART, NAMESPACE, ROOT, helm, pod_templates, render

RECIPE = ROOT / "deploy" / "kimi-k26-h200.yaml"
CLUSTER = "kimi-k26"  # router.clusterName's default
NAMESPACES: dict[str, dict[str, str]] = {
    NAMESPACE: {},
    "ingress-nginx": {},
    "monitoring": {},
    "team-b": {},
    "default": {},
}
EXTERNAL = ipaddress.IPv4Address("203.0.113.7")
NCCL_PORT = 45123  # NCCL and torch.distributed also open ephemeral ports between the ranks of a group


def recipe_spec(**transfer: Any) -> PDClusterSpec:
    """The K2.6 recipe on pod networking (its hostNetwork pods are outside NetworkPolicy, operator/README.md)."""
    spec = yaml.safe_load(RECIPE.read_text())["spec"]
    spec["transfer"] = {**spec["transfer"], "hostNetwork": False, "protocol": "tcp", **transfer}
    return PDClusterSpec.model_validate(spec)


def worker_pods(cluster: str, namespace: str, role: Role, epoch: int = 0) -> list[Pod]:
    """The operator's own pod manifests for group 0 of ``role``: its labels and named ports."""
    owner = OwnerRef("tandem.dev/v1alpha1", "PDPool", f"{cluster}-{role.value}", "uid")
    ctx = RoleContext.build(ClusterRef(cluster, namespace, "uid"), recipe_spec(), role, owner)
    return [as_pod(m, namespace) for m in group_manifests(ctx, 0, epoch) if m["kind"] == "Pod"]


def as_pod(manifest: dict[str, Any], namespace: str) -> Pod:
    spec = manifest["spec"]
    containers = [*spec.get("initContainers", []), *spec["containers"]]
    ports = {p["name"]: p["containerPort"] for c in containers for p in c.get("ports", []) if "name" in p}
    labels = manifest["metadata"]["labels"]
    name = manifest["metadata"].get("name", labels.get("app.kubernetes.io/component", "?"))
    return Pod(name, namespace, labels, ports, host_network=spec.get("hostNetwork", False))


def chart_pods(docs: list[dict[str, Any]]) -> dict[str, Pod]:
    """The chart's pods by component (router, operator, etcd, mooncake-etcd, mooncake-master, helm-test)."""
    pods = [as_pod(t, NAMESPACE) for t in pod_templates(docs).values()]
    return {p.labels["app.kubernetes.io/component"]: p for p in pods}


def other(name: str, namespace: str, **labels: str) -> Pod:
    return Pod(name, namespace, labels)


class World:
    """Chart pods, the operator's workers of two PDClusters in the release namespace and one elsewhere, and pods
    that are not Tandem's, by key."""

    def __init__(self, *sets: str, values: Path | None = None) -> None:
        args = ["--set", "mooncakeMaster.enabled=true"]  # with the registry's TLS: the chart's Mooncake etcd too
        args += [a for s in sets for a in ("--set", s)]
        args += ["-f", str(values)] if values else []
        docs = render(*args)
        self.policies = network_policies(docs)
        self.cluster = Cluster(NAMESPACES, self.policies)
        self.pods: dict[str, Pod] = {
            **chart_pods(docs),
            "prefill": worker_pods(CLUSTER, NAMESPACE, Role.PREFILL)[0],
            "decode": worker_pods(CLUSTER, NAMESPACE, Role.DECODE)[0],
            "decode-next": worker_pods(CLUSTER, NAMESPACE, Role.DECODE, epoch=1)[0],  # its next Mooncake window
            "stranger": worker_pods("other", NAMESPACE, Role.DECODE)[0],  # another PDCluster's worker
            "team-b": worker_pods("kimi-b", "team-b", Role.DECODE)[0],
            "ingress": other(
                "ingress-nginx-controller", "ingress-nginx", **{"app.kubernetes.io/name": "ingress-nginx"}
            ),
            "prometheus": other("prometheus-0", "monitoring", **{"app.kubernetes.io/name": "prometheus"}),
            "grafana": other("grafana", "monitoring", **{"app.kubernetes.io/name": "grafana"}),
            "rogue": other("rogue", NAMESPACE, app="rogue"),
            "faker": other("fake-ingress", "default", **{"app.kubernetes.io/name": "ingress-nginx"}),
        }

    def allows(self, source: str, dest: str, port: int | str, cluster: Cluster | None = None) -> bool:
        """Whether pod ``source`` (or "external": an address outside the cluster) reaches ``port`` of ``dest``."""
        target = self.pods[dest]
        if port == "mooncake":
            port = first_mooncake_port(target)
        origin: Source = EXTERNAL if source == "external" else self.pods[source]
        return (cluster or self.cluster).allows(origin, target, port)


@pytest.fixture(scope="module")
def world() -> World:
    return World()


def first_mooncake_port(pod: Pod) -> str:
    return next(name for name in pod.ports if name.startswith("mooncake-"))


# (what, source, destination, port, allowed?) with the chart's defaults. Sources and destinations are World.pods
# keys; "mooncake" is the destination's first Mooncake port.
FLOWS: list[tuple[str, str, str, int | str, bool]] = [
    # router HTTP: the ingress namespace of the values, monitoring, the release's helm test
    ("ingress controller -> router", "ingress", "router", "http", True),
    ("helm test -> router", "helm-test", "router", "http", True),
    ("prometheus -> router metrics", "prometheus", "router", "http", True),
    ("operator -> router metrics (autoscaling)", "operator", "router", "http", True),
    ("pod in the release namespace -> router", "rogue", "router", "http", False),
    ("ingress-labelled pod elsewhere -> router", "faker", "router", "http", False),
    ("grafana (monitoring, not prometheus) -> router", "grafana", "router", "http", False),
    ("external address -> router (no cidrs)", "external", "router", "http", False),
    ("worker -> router", "decode", "router", "http", False),
    # worker HTTP and bootstrap: routers, peer workers; HTTP: the operator, monitoring
    ("router -> prefill http", "router", "prefill", "http", True),
    ("router -> prefill bootstrap", "router", "prefill", "bootstrap", True),
    ("router -> decode http", "router", "decode", "http", True),
    ("decode -> prefill bootstrap", "decode", "prefill", "bootstrap", True),
    ("prefill -> decode http", "prefill", "decode", "http", True),
    ("operator -> worker http (drain, pairing)", "operator", "decode", "http", True),
    ("prometheus -> worker http (PodMonitor)", "prometheus", "prefill", "http", True),
    ("pod in the release namespace -> worker http", "rogue", "decode", "http", False),
    ("pod in the release namespace -> prefill bootstrap", "rogue", "prefill", "bootstrap", False),
    ("ingress controller -> worker http", "ingress", "decode", "http", False),
    ("another PDCluster's worker -> prefill bootstrap", "stranger", "prefill", "bootstrap", False),
    ("another namespace's worker -> worker http", "team-b", "decode", "http", False),
    ("operator -> prefill bootstrap", "operator", "prefill", "bootstrap", False),
    ("prometheus -> prefill bootstrap", "prometheus", "prefill", "bootstrap", False),
    ("etcd -> worker http", "etcd", "decode", "http", False),
    # Mooncake, torch.distributed and NCCL ports: only between the cluster's workers
    ("prefill -> decode mooncake", "prefill", "decode", "mooncake", True),
    ("prefill -> decode mooncake (next epoch's window)", "prefill", "decode-next", "mooncake", True),
    ("decode -> decode dist-init", "decode", "decode-next", "dist-init", True),
    ("decode -> decode NCCL ephemeral port", "decode", "decode-next", NCCL_PORT, True),
    ("router -> decode mooncake", "router", "decode", "mooncake", False),
    ("operator -> decode mooncake", "operator", "decode", "mooncake", False),
    ("prometheus -> decode mooncake", "prometheus", "decode", "mooncake", False),
    ("pod in the release namespace -> decode mooncake", "rogue", "decode", "mooncake", False),
    ("another PDCluster's worker -> decode mooncake", "stranger", "decode", "mooncake", False),
    ("another namespace's worker -> decode mooncake", "team-b", "decode", "mooncake", False),
    ("router -> decode dist-init", "router", "decode", "dist-init", False),
    ("kimi-k26 worker -> another PDCluster's mooncake", "prefill", "stranger", "mooncake", False),
    # registry etcd (TLS) client port: operator, routers, the set-up Job (workers and the Mooncake master have no
    # certificate: Mooncake's keys are in the Mooncake etcd); peer port: members only
    ("operator -> etcd", "operator", "etcd", "client", True),
    ("router -> etcd", "router", "etcd", "client", True),
    ("etcd member -> etcd peer", "etcd", "etcd", "peer", True),
    ("etcd-auth set-up Job -> etcd (users and roles)", "etcd-auth", "etcd", "client", True),
    ("prefill -> registry etcd (TLS: Mooncake's keys are elsewhere)", "prefill", "etcd", "client", False),
    ("another PDCluster's worker -> etcd", "stranger", "etcd", "client", False),
    ("mooncake master -> registry etcd (TLS)", "mooncake-master", "etcd", "client", False),
    ("pod in the release namespace -> etcd", "rogue", "etcd", "client", False),
    ("helm test -> etcd", "helm-test", "etcd", "client", False),
    ("ingress controller -> etcd", "ingress", "etcd", "client", False),
    ("prometheus -> etcd", "prometheus", "etcd", "client", False),
    ("team-b worker -> etcd (namespace not listed)", "team-b", "etcd", "client", False),
    ("router -> etcd peer", "router", "etcd", "peer", False),
    ("worker -> etcd peer", "decode", "etcd", "peer", False),
    # Mooncake etcd (plaintext): the release's workers (Transfer Engine metadata, master lookup), the master (HA
    # leader key), the operator (stale Mooncake entries after a fence); peer port: members only
    ("prefill -> mooncake etcd", "prefill", "mooncake-etcd", "client", True),
    ("decode -> mooncake etcd", "decode", "mooncake-etcd", "client", True),
    ("mooncake master -> mooncake etcd (HA leader key)", "mooncake-master", "mooncake-etcd", "client", True),
    ("operator -> mooncake etcd (stale entries)", "operator", "mooncake-etcd", "client", True),
    ("mooncake etcd member -> mooncake etcd peer", "mooncake-etcd", "mooncake-etcd", "peer", True),
    ("another PDCluster's worker -> mooncake etcd", "stranger", "mooncake-etcd", "client", False),
    ("team-b worker -> mooncake etcd (namespace not listed)", "team-b", "mooncake-etcd", "client", False),
    ("router -> mooncake etcd", "router", "mooncake-etcd", "client", False),
    ("pod in the release namespace -> mooncake etcd", "rogue", "mooncake-etcd", "client", False),
    ("helm test -> mooncake etcd", "helm-test", "mooncake-etcd", "client", False),
    ("prometheus -> mooncake etcd", "prometheus", "mooncake-etcd", "client", False),
    ("ingress controller -> mooncake etcd", "ingress", "mooncake-etcd", "client", False),
    ("registry etcd member -> mooncake etcd", "etcd", "mooncake-etcd", "client", False),
    ("etcd-auth set-up Job -> mooncake etcd", "etcd-auth", "mooncake-etcd", "client", False),
    ("worker -> mooncake etcd peer", "decode", "mooncake-etcd", "peer", False),
    ("registry etcd member -> mooncake etcd peer", "etcd", "mooncake-etcd", "peer", False),
    # Mooncake master RPC: workers only; metrics: monitoring
    ("prefill -> mooncake master rpc", "prefill", "mooncake-master", "rpc", True),
    ("decode -> mooncake master rpc", "decode", "mooncake-master", "rpc", True),
    ("prometheus -> mooncake master metrics", "prometheus", "mooncake-master", "metrics", True),
    ("router -> mooncake master rpc", "router", "mooncake-master", "rpc", False),
    ("operator -> mooncake master rpc", "operator", "mooncake-master", "rpc", False),
    ("pod in the release namespace -> mooncake master rpc", "rogue", "mooncake-master", "rpc", False),
    ("team-b worker -> mooncake master rpc (namespace not listed)", "team-b", "mooncake-master", "rpc", False),
    ("prometheus -> mooncake master rpc", "prometheus", "mooncake-master", "rpc", False),
    ("worker -> mooncake master metrics", "decode", "mooncake-master", "metrics", False),
    # operator: metrics from monitoring only
    ("prometheus -> operator metrics", "prometheus", "operator", "metrics", True),
    ("pod in the release namespace -> operator metrics", "rogue", "operator", "metrics", False),
    ("router -> operator metrics", "router", "operator", "metrics", False),
]


@pytest.mark.parametrize(("source", "dest", "port", "allowed"), [f[1:] for f in FLOWS], ids=[f[0] for f in FLOWS])
def test_flow(world: World, source: str, dest: str, port: int | str, allowed: bool) -> None:
    assert world.allows(source, dest, port) is allowed


def test_every_denied_flow_is_denied_by_a_policy() -> None:
    """Without the chart's policies every flow above is open: the denials come from the rendered policies."""
    w = World("networkPolicy.enabled=false")
    assert w.policies == []
    assert all(w.allows(source, dest, port) for _, source, dest, port, _ in FLOWS)


def test_every_pod_is_isolated_and_every_named_port_resolves(world: World) -> None:
    """Each Tandem pod that listens is selected by some policy, and every named port a policy lists exists on a pod
    it selects (a misspelt named port matches nothing and silently denies)."""
    tandem = [p for p in world.pods.values() if p.labels.get("app.kubernetes.io/name", "").startswith("tandem")]
    # The helm test pod listens on nothing; team-b's worker is outside the release namespace (workerNamespaces
    # only lets it reach etcd and the Mooncake master).
    pods = [p for p in tandem if p.ports and p.namespace == NAMESPACE]
    assert len(pods) == 9  # router, operator, etcd, Mooncake etcd, Mooncake master; 4 workers
    for pod in pods:
        assert world.cluster.ingress_policies(pod), f"{pod.name} is not isolated"
    for policy in world.policies:
        selected = [p for p in pods if policy in world.cluster.ingress_policies(p)]
        assert selected, f"{policy['metadata']['name']} selects no pod"
        for rule in policy["spec"]["ingress"]:
            for entry in rule.get("ports", []):
                assert any(entry["port"] in p.ports for p in selected), (policy["metadata"]["name"], entry)


def test_values_name_the_router_ingress_and_worker_peers() -> None:
    w = World(
        "networkPolicy.routerFrom[0].namespaceLabels.team=edge",
        "networkPolicy.routerFrom[0].podLabels.app=gateway",
        "networkPolicy.routerCidrs[0]=203.0.113.0/24",
        "networkPolicy.workerClusters[0]=other",
        "networkPolicy.workerNamespaces[0]=team-b",
    )
    w.pods["gateway"] = other("gw", "edge", app="gateway")
    w.pods["edge-other"] = other("x", "edge", app="other")
    w.pods["team-b-other"] = other("x", "team-b", app="x")
    w.pods["stranger-peer"] = worker_pods("other", NAMESPACE, Role.PREFILL)[0]
    cluster = Cluster({**NAMESPACES, "edge": {"team": "edge"}}, w.policies)
    assert w.allows("gateway", "router", "http", cluster)
    assert not w.allows("edge-other", "router", "http", cluster)
    assert not w.allows("ingress", "router", "http", cluster)  # the default namespace is replaced
    assert w.allows("external", "router", "http", cluster)
    # workerClusters replaces router.clusterName: "other"'s workers reach each other, kimi-k26's no longer do
    assert w.allows("stranger-peer", "stranger", "mooncake", cluster)
    assert not w.allows("prefill", "decode", "mooncake", cluster)
    assert w.allows("stranger-peer", "mooncake-etcd", "client", cluster)
    assert not w.allows("prefill", "mooncake-etcd", "client", cluster)
    assert w.allows("team-b", "mooncake-etcd", "client", cluster)
    assert w.allows("team-b", "mooncake-master", "rpc", cluster)
    assert not w.allows("team-b-other", "mooncake-etcd", "client", cluster)
    assert not w.allows("team-b", "etcd", "client", cluster)  # the registry's TLS: no worker needs it


def recipe_worker() -> Pod:
    """A decode pod of the K2.6 recipe as shipped: hostNetwork, on a node at 10.20.0.5."""
    spec = PDClusterSpec.model_validate(yaml.safe_load(RECIPE.read_text())["spec"])
    owner = OwnerRef("tandem.dev/v1alpha1", "PDPool", "kimi-k26-decode", "uid")
    ctx = RoleContext.build(ClusterRef(CLUSTER, NAMESPACE, "uid"), spec, Role.DECODE, owner)
    (pod,) = (as_pod(m, NAMESPACE) for m in group_manifests(ctx, 0) if m["kind"] == "Pod")
    return replace(pod, node_ip=ipaddress.IPv4Address("10.20.0.5"))


def test_host_network_workers_are_outside_network_policy(world: World) -> None:
    """What operator/README.md states: the K2.6 recipe's hostNetwork workers are not protected by any policy, and
    reach the Mooncake etcd and master only through networkPolicy.workerCidrs (they connect from their node)."""
    world.pods["hostnet"] = recipe_worker()
    assert world.pods["hostnet"].host_network
    assert world.cluster.ingress_policies(world.pods["hostnet"])  # selected, yet not enforced on the node's network
    assert world.allows("rogue", "hostnet", "mooncake")
    assert not world.allows("hostnet", "mooncake-etcd", "client")
    assert not world.allows("hostnet", "mooncake-master", "rpc")
    opened = World("networkPolicy.workerCidrs[0]=10.20.0.0/16")
    opened.pods["hostnet"] = world.pods["hostnet"]
    assert opened.allows("hostnet", "mooncake-etcd", "client")
    assert opened.allows("hostnet", "mooncake-master", "rpc")
    assert not opened.allows("hostnet", "mooncake-etcd", "peer")
    assert not opened.allows("hostnet", "etcd", "client")  # the registry (TLS) is not the workers' business
    assert not opened.allows("hostnet", "router", "http")


def test_no_monitoring_peers_closes_the_metrics_ports() -> None:
    """An empty monitoringFrom must not render a rule without peers (which would let everyone in)."""
    w = World("networkPolicy.monitoringFrom=null")
    assert not w.allows("prometheus", "operator", "metrics")
    assert not w.allows("rogue", "operator", "metrics")
    assert not w.allows("rogue", "mooncake-master", "metrics")
    assert not w.allows("prometheus", "decode", "http")
    assert w.allows("router", "decode", "http")


def test_long_cluster_names_get_a_valid_policy_name() -> None:
    long = "c" * 48  # the longest PDCluster name the CRD accepts
    docs = render("--set", f"networkPolicy.workerClusters[0]={long}", release="a-very-long-release-name-for-tandem")
    names = [p["metadata"]["name"] for p in network_policies(docs)]
    assert all(len(n) <= 63 for n in names), names
    [peer] = [p for p in network_policies(docs) if "tandem.dev/cluster" in p["spec"]["podSelector"]["matchLabels"]]
    assert peer["spec"]["podSelector"]["matchLabels"]["tandem.dev/cluster"] == long


def test_invalid_worker_cluster_is_rejected_with_the_key_named() -> None:
    result = helm("template", "t", str(CHART), "--set", "networkPolicy.workerClusters[0]=Not_A_Name")
    assert result.returncode != 0
    assert "/networkPolicy/workerClusters/0" in result.stderr


def test_production_values_serve_the_k26_recipe() -> None:
    """deploy/values-production.yaml with deploy/kimi-k26-h200.yaml: the LoadBalancer's clients reach the router,
    the hostNetwork workers (nodes in 10.0.0.0/8) reach the Mooncake etcd and master but not the registry etcd
    (TLS), strangers reach none of them."""
    w = World(values=ROOT / "deploy" / "values-production.yaml")
    w.pods["hostnet"] = recipe_worker()
    assert w.allows("external", "router", "http")
    assert w.allows("hostnet", "mooncake-etcd", "client")
    assert w.allows("hostnet", "mooncake-master", "rpc")
    assert w.allows("mooncake-master", "mooncake-etcd", "client")
    assert w.allows("router", "etcd", "client")
    assert not w.allows("hostnet", "etcd", "client")
    assert not w.allows("mooncake-master", "etcd", "client")
    for dest, port in (("etcd", "client"), ("mooncake-etcd", "client"), ("mooncake-master", "rpc")):
        assert not w.allows("rogue", dest, port)


def test_without_tls_mooncake_keys_stay_in_the_registry_etcd() -> None:
    """etcd.tls.enabled=false: no Mooncake etcd; the workers and the master reach the registry etcd as before."""
    w = World("etcd.tls.enabled=false")
    assert "mooncake-etcd" not in w.pods
    assert all(p["metadata"]["name"] != "t-tandem-mooncake-etcd" for p in w.policies)
    assert w.allows("prefill", "etcd", "client")
    assert w.allows("stranger", "etcd", "client")
    assert w.allows("mooncake-master", "etcd", "client")
    assert not w.allows("rogue", "etcd", "client")
