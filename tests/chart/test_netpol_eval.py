"""The NetworkPolicy evaluator the chart's render tests rely on (tests/chart/netpol.py), on hand-written policies
whose outcome the Kubernetes API reference states."""

from __future__ import annotations

import ipaddress
from typing import Any

import pytest

from tests.chart.netpol import Cluster, Pod, UnmodelledPolicyError, selects

NAMESPACES = {"a": {"team": "x"}, "b": {"team": "y"}}
WEB = Pod("web", "a", {"app": "web"}, {"http": 8080, "admin": 9000})
CLIENT_A = Pod("client", "a", {"role": "client"})
CLIENT_B = Pod("client", "b", {"role": "client"})
OTHER_A = Pod("other", "a", {"role": "other"})


def policy(*ingress: dict[str, Any], namespace: str = "a", selector: dict[str, Any] | None = None) -> dict[str, Any]:
    spec = {"podSelector": selector if selector is not None else {"matchLabels": {"app": "web"}}}
    return {"metadata": {"name": "p", "namespace": namespace}, "spec": {**spec, "ingress": list(ingress)}}


def test_unselected_pods_accept_everything_and_selected_ones_only_what_a_rule_allows() -> None:
    assert Cluster(NAMESPACES, []).allows(CLIENT_B, WEB, "http")
    deny_all = Cluster(NAMESPACES, [policy()])
    assert not deny_all.allows(CLIENT_A, WEB, "http")
    other_namespace = Cluster(NAMESPACES, [policy(namespace="b")])
    assert other_namespace.allows(CLIENT_A, WEB, "http")


def test_pod_selector_alone_means_the_policy_namespace() -> None:
    c = Cluster(NAMESPACES, [policy({"from": [{"podSelector": {"matchLabels": {"role": "client"}}}]})])
    assert c.allows(CLIENT_A, WEB, 8080)
    assert not c.allows(CLIENT_B, WEB, 8080)
    assert not c.allows(OTHER_A, WEB, 8080)


def test_namespace_and_pod_selector_in_one_peer_both_apply_in_two_peers_either() -> None:
    both = {"namespaceSelector": {"matchLabels": {"team": "y"}}, "podSelector": {"matchLabels": {"role": "client"}}}
    c = Cluster(NAMESPACES, [policy({"from": [both]})])
    assert c.allows(CLIENT_B, WEB, "http")
    assert not c.allows(CLIENT_A, WEB, "http")
    assert not c.allows(Pod("o", "b", {"role": "other"}), WEB, "http")
    either = [{"namespaceSelector": {"matchLabels": {"team": "y"}}}, {"podSelector": {"matchLabels": {"role": "x"}}}]
    c = Cluster(NAMESPACES, [policy({"from": either})])
    assert c.allows(Pod("o", "b", {"role": "other"}), WEB, "http")
    assert not c.allows(CLIENT_A, WEB, "http")


def test_the_namespace_name_label_is_set() -> None:
    peer = {"namespaceSelector": {"matchLabels": {"kubernetes.io/metadata.name": "b"}}}
    c = Cluster(NAMESPACES, [policy({"from": [peer]})])
    assert c.allows(CLIENT_B, WEB, "http")
    assert not c.allows(CLIENT_A, WEB, "http")


def test_ports_by_name_number_and_range() -> None:
    c = Cluster(NAMESPACES, [policy({"ports": [{"port": "http"}]})])
    assert c.allows(CLIENT_B, WEB, 8080)
    assert not c.allows(CLIENT_B, WEB, "admin")
    assert not c.allows(CLIENT_B, Pod("bare", "a", {"app": "web"}, {"web": 8080}), 8080)  # the name is missing
    c = Cluster(NAMESPACES, [policy({"ports": [{"port": 9000, "endPort": 9010}]})])
    assert c.allows(CLIENT_B, WEB, 9005)
    assert not c.allows(CLIENT_B, WEB, 8080)
    c = Cluster(NAMESPACES, [policy({"ports": [{"port": 8080, "protocol": "UDP"}]})])
    assert not c.allows(CLIENT_B, WEB, 8080)


def test_rules_and_policies_add_up() -> None:
    only_admin = policy({"ports": [{"port": "admin"}], "from": [{"podSelector": {}}]})
    only_http = policy({"ports": [{"port": "http"}]})
    c = Cluster(NAMESPACES, [only_admin, only_http])
    assert c.allows(CLIENT_B, WEB, "http")
    assert c.allows(CLIENT_A, WEB, "admin")
    assert not c.allows(CLIENT_B, WEB, "admin")


def test_ip_blocks_match_outside_addresses_only() -> None:
    c = Cluster(NAMESPACES, [policy({"from": [{"ipBlock": {"cidr": "10.0.0.0/8", "except": ["10.1.0.0/16"]}}]})])
    assert c.allows(ipaddress.IPv4Address("10.2.0.1"), WEB, "http")
    assert not c.allows(ipaddress.IPv4Address("10.1.0.1"), WEB, "http")
    assert not c.allows(CLIENT_A, WEB, "http")


def test_host_network_pods_are_not_subject_to_policy_and_come_from_their_node() -> None:
    pod = Pod("hostnet", "a", {"app": "web"}, {"http": 8080}, host_network=True)
    assert Cluster(NAMESPACES, [policy()]).allows(CLIENT_B, pod, "http")
    client = Pod("hostnet", "a", {"role": "client"}, host_network=True, node_ip=ipaddress.IPv4Address("192.0.2.9"))
    by_label = Cluster(NAMESPACES, [policy({"from": [{"podSelector": {}}]})])
    assert by_label.allows(CLIENT_A, WEB, "http")
    assert not by_label.allows(client, WEB, "http")
    by_node = Cluster(NAMESPACES, [policy({"from": [{"ipBlock": {"cidr": "192.0.2.0/24"}}]})])
    assert by_node.allows(client, WEB, "http")


@pytest.mark.parametrize(
    ("selector", "labels", "expected"),
    [
        ({}, {}, True),
        ({"matchExpressions": [{"key": "a", "operator": "In", "values": ["1", "2"]}]}, {"a": "2"}, True),
        ({"matchExpressions": [{"key": "a", "operator": "In", "values": ["1"]}]}, {}, False),
        ({"matchExpressions": [{"key": "a", "operator": "NotIn", "values": ["1"]}]}, {}, True),
        ({"matchExpressions": [{"key": "a", "operator": "NotIn", "values": ["1"]}]}, {"a": "1"}, False),
        ({"matchExpressions": [{"key": "a", "operator": "Exists"}]}, {"a": ""}, True),
        ({"matchExpressions": [{"key": "a", "operator": "DoesNotExist"}]}, {"a": ""}, False),
        ({"matchLabels": {"a": "1"}, "matchExpressions": [{"key": "b", "operator": "Exists"}]}, {"a": "1"}, False),
    ],
)
def test_label_selectors(selector: dict[str, Any], labels: dict[str, str], expected: bool) -> None:
    assert selects(selector, labels) is expected


def test_what_it_does_not_model_raises() -> None:
    egress = {"metadata": {"name": "e", "namespace": "a"}, "spec": {"podSelector": {}, "policyTypes": ["Egress"]}}
    with pytest.raises(UnmodelledPolicyError, match="egress policies are not evaluated"):
        Cluster(NAMESPACES, [egress]).allows(CLIENT_A, WEB, "http")
    with pytest.raises(ValueError, match="unknown LabelSelector"):
        selects({"matchLabel": {"a": "1"}}, {})
    with pytest.raises(KeyError, match="not declared"):
        Cluster(NAMESPACES, [policy({"from": [{"namespaceSelector": {}}]})]).allows(
            Pod("x", "nowhere", {}), WEB, "http"
        )
