"""``spec.fabric``: placement of each group inside one RDMA fabric domain, validation, the template hash, and the
domain the registry entries carry (pure, plus the node-label reader against a fake API)."""

from __future__ import annotations

import builtins
from typing import Any

import pydantic
import pytest

from tandem.registry import FabricMode, Role
from tandem_operator.act.k8s.nodes import NodeDomains
from tandem_operator.api.messages import api_messages
from tandem_operator.api.pdcluster import PDClusterSpec
from tandem_operator.decide.observe import GroupKey, GroupState, GroupView
from tandem_operator.decide.registration import desired_endpoints, leader_endpoint, leader_nodes
from tandem_operator.desired.fabric import node_domain
from tandem_operator.desired.naming import LABEL_RANK
from tandem_operator.desired.pods import group_manifests
from tests.operator.conftest import KIMI_8XH200, kimi_spec, role_hash
from tests.operator.fakes import FakeKube
from tests.operator.test_desired import ctx
from tests.operator.workers import live_pod

RACK = "topology.example.com/rack"
FABRIC = {"domainLabel": RACK}


def _pods(spec: PDClusterSpec, role: Role) -> list[dict[str, Any]]:
    return [m for m in group_manifests(ctx(spec, role), 3) if m["kind"] == "Pod"]


def _pod_affinity(pod: dict[str, Any]) -> list[dict[str, Any]]:
    terms: list[dict[str, Any]] = (
        pod["spec"]["affinity"].get("podAffinity", {}).get("requiredDuringSchedulingIgnoredDuringExecution", [])
    )
    return terms


def test_every_rank_of_a_group_requires_the_groups_pods_in_its_domain() -> None:
    spec = kimi_spec(fabric=FABRIC, decode={**KIMI_8XH200["decode"], "topologyKey": None})
    group = {"tandem.dev/cluster": "kimi", "tandem.dev/role": "decode", "tandem.dev/group": "3"}
    pods = _pods(spec, Role.DECODE)
    assert len(pods) == 2
    for pod in pods:  # the leader too: whichever rank is scheduled first picks the domain for the others
        assert _pod_affinity(pod) == [{"labelSelector": {"matchLabels": group}, "topologyKey": RACK}]
        anti = pod["spec"]["affinity"]["podAntiAffinity"]["requiredDuringSchedulingIgnoredDuringExecution"]
        assert anti == [{"labelSelector": {"matchLabels": group}, "topologyKey": "kubernetes.io/hostname"}]
    (prefill,) = _pods(spec, Role.PREFILL)  # one node: still only on a labelled node (its entry gets a domain)
    assert [t["topologyKey"] for t in _pod_affinity(prefill)] == [RACK]


def test_fabric_and_a_roles_topology_key_both_hold() -> None:
    spec = kimi_spec(fabric=FABRIC)  # the decode role also follows its leader by example.com/rack
    leader, follower = _pods(spec, Role.DECODE)
    assert [t["topologyKey"] for t in _pod_affinity(leader)] == [RACK]
    assert [t["topologyKey"] for t in _pod_affinity(follower)] == [RACK, "example.com/rack"]
    assert _pod_affinity(follower)[1]["labelSelector"]["matchLabels"][LABEL_RANK] == "0"


def test_without_fabric_no_pod_affinity_is_added() -> None:
    spec = kimi_spec(decode={**KIMI_8XH200["decode"], "topologyKey": None})
    assert all(_pod_affinity(pod) == [] for pod in _pods(spec, Role.DECODE) + _pods(spec, Role.PREFILL))


def test_the_domain_label_rolls_the_pods_the_mode_does_not() -> None:
    plain = kimi_spec()
    preferred = kimi_spec(fabric=FABRIC)
    required = kimi_spec(fabric={**FABRIC, "mode": "Required"})
    other = kimi_spec(fabric={"domainLabel": "nvidia.com/gpu.clique"})
    for role in Role:
        hashes = {role_hash(s, role) for s in (plain, preferred, other)}
        assert len(hashes) == 3
        assert role_hash(preferred, role) == role_hash(required, role)


@pytest.mark.parametrize(
    ("fabric", "message"),
    [
        ({"domainLabel": ""}, 'spec.fabric.domainLabel: Invalid value: "": spec.fabric.domainLabel in body should'),
        ({"domainLabel": "rack id"}, 'spec.fabric.domainLabel: Invalid value: "rack id"'),
        ({"domainLabel": "-rack"}, 'spec.fabric.domainLabel: Invalid value: "-rack"'),
        ({"domainLabel": "Example.com/rack"}, 'spec.fabric.domainLabel: Invalid value: "Example.com/rack"'),
        ({}, "spec.fabric.domainLabel: Required value"),
        (
            {**FABRIC, "mode": "Always"},
            'spec.fabric.mode: Unsupported value: "Always": supported values: "Preferred", "Required"',
        ),
        (
            {"domainLabel": "kubernetes.io/hostname"},  # the decode groups span two nodes
            'spec.fabric.domainLabel: Invalid value: "object": fabric.domainLabel kubernetes.io/hostname makes a node '
            "its own domain",
        ),
    ],
)
def test_bad_fabric_specs_are_refused_naming_the_field(fabric: dict[str, Any], message: str) -> None:
    with pytest.raises(pydantic.ValidationError) as err:
        kimi_spec(fabric=fabric)
    assert any(line.startswith(message) for line in api_messages(err.value)), api_messages(err.value)


def test_valid_domain_labels() -> None:
    for label in ("rack", "topology.kubernetes.io/zone", "nvidia.com/gpu.clique", "example.com/Rail_Group.2"):
        spec = kimi_spec(fabric={"domainLabel": label})
        assert spec.fabric is not None
        assert spec.fabric.mode.value == "Preferred"  # the default
    one_node = {"nodesPerGroup": 1, "tpSize": 8, "epSize": 8, "attnDpSize": 8}
    assert kimi_spec(fabric={"domainLabel": "kubernetes.io/hostname"}, decode=one_node).fabric is not None


def test_node_domain() -> None:
    node = {"metadata": {"name": "n1", "labels": {RACK: "r7", "other": "x"}}}
    assert node_domain(node, RACK) == "r7"
    assert node_domain(node, "missing") is None
    assert node_domain({"metadata": {"labels": {RACK: ""}}}, RACK) is None
    assert node_domain(None, RACK) is None  # the node is gone


def test_registry_entries_carry_the_leaders_node_domain_and_the_mode() -> None:
    spec = kimi_spec(fabric={**FABRIC, "mode": "Required"})
    leader = live_pod(spec, Role.PREFILL, 0, 0, node="gpu-7")
    endpoint = leader_endpoint(spec, Role.PREFILL, leader, node_domains={"gpu-7": "r2", "gpu-8": "r3"})
    assert endpoint is not None
    assert (endpoint.fabric_domain, endpoint.fabric_mode) == ("r2", FabricMode.REQUIRED)
    unknown = leader_endpoint(spec, Role.PREFILL, leader, node_domains={"gpu-8": "r3"})
    assert unknown is not None
    assert (unknown.fabric_domain, unknown.fabric_mode) == (None, FabricMode.REQUIRED)
    preferred = leader_endpoint(kimi_spec(fabric=FABRIC), Role.PREFILL, leader, node_domains={"gpu-7": "r2"})
    assert preferred is not None
    assert preferred.fabric_mode is FabricMode.PREFERRED
    plain = leader_endpoint(kimi_spec(), Role.PREFILL, live_pod(kimi_spec(), Role.PREFILL, 0, 0, node="gpu-7"), (), {})
    assert plain is not None
    assert (plain.fabric_domain, plain.fabric_mode) == (None, None)  # no fabric declared: nothing in the entry


def test_desired_endpoints_take_each_groups_leader_node() -> None:
    spec = kimi_spec(fabric=FABRIC)
    pods = [
        live_pod(spec, Role.DECODE, 0, 0, node="gpu-0", ip="10.0.0.1"),
        live_pod(spec, Role.DECODE, 0, 1, node="gpu-1", ip="10.0.0.2"),  # a follower's node is not asked
        live_pod(spec, Role.DECODE, 1, 0, node="gpu-4", ip="10.0.0.3"),
        live_pod(spec, Role.DECODE, 1, 1, node="gpu-5", ip="10.0.0.4"),
    ]
    assert leader_nodes(pods) == {"gpu-0", "gpu-4"}
    views = {i: GroupView(i, GroupState.READY, "h", ()) for i in (0, 1)}
    desired = desired_endpoints(spec, Role.DECODE, views, pods, {}, {"gpu-0": "r0", "gpu-4": "r1", "gpu-1": "rX"})
    domains = {key: e.fabric_domain for key, e in desired.items()}
    assert domains == {GroupKey(Role.DECODE, 0): "r0", GroupKey(Role.DECODE, 1): "r1"}


class NodeKube(FakeKube):
    """Nodes by path, and every GET counted."""

    def __init__(self, nodes: dict[str, dict[str, str]]) -> None:
        super().__init__()
        self.gets: builtins.list[str] = []
        for name, labels in nodes.items():
            self.objects[f"/api/v1/nodes/{name}"] = {"metadata": {"name": name, "labels": labels}}

    async def get(self, path: str) -> dict[str, Any] | None:
        self.gets.append(path)
        return await super().get(path)


async def test_node_domains_reads_each_node_once_while_a_leader_runs_there() -> None:
    kube = NodeKube({"n0": {RACK: "r0"}, "n1": {RACK: "r1"}, "bare": {}})
    domains = NodeDomains(kube)
    assert await domains.resolve(RACK, {"n0", "n1", "bare", "gone"}) == {"n0": "r0", "n1": "r1"}
    assert sorted(kube.gets) == ["/api/v1/nodes/bare", "/api/v1/nodes/gone", "/api/v1/nodes/n0", "/api/v1/nodes/n1"]
    kube.gets.clear()
    assert await domains.resolve(RACK, {"n0", "n1"}) == {"n0": "r0", "n1": "r1"}
    assert kube.gets == []  # known: no request in a steady pass
    kube.objects["/api/v1/nodes/n0"]["metadata"]["labels"][RACK] = "r9"  # relabelled while a leader runs there
    assert (await domains.resolve(RACK, {"n0"}))["n0"] == "r0"  # the pod did not move
    assert await domains.resolve(RACK, set()) == {}  # no leader there any more: forgotten
    assert await domains.resolve(RACK, {"n0"}) == {"n0": "r9"}  # a new leader there: read again
    assert await domains.resolve("other", {"n0"}) == {}  # another label: read again
    assert kube.gets == ["/api/v1/nodes/n0", "/api/v1/nodes/n0"]
