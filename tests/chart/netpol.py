"""A small, strict evaluator of Kubernetes NetworkPolicy ingress rules, for the chart's render tests.

It answers "may this source open a TCP connection to this port of this pod?" for rendered ``networking.k8s.io/v1``
NetworkPolicies, following the API reference (NetworkPolicySpec, NetworkPolicyIngressRule, NetworkPolicyPeer,
NetworkPolicyPort, LabelSelector):

* a pod no Ingress policy selects accepts everything; a selected pod accepts a connection when any rule of any
  policy selecting it allows it (rules only add);
* a rule without ``from`` (or with an empty list) allows every source, without ``ports`` every port;
* a peer with only ``podSelector`` means pods of the policy's namespace, with only ``namespaceSelector`` every pod
  of the matching namespaces, with both the matching pods of the matching namespaces; an empty selector matches
  all; namespaces carry ``kubernetes.io/metadata.name`` as the API server sets it;
* a named port is resolved against the destination pod's container ports (no such name: no match);
* ``hostNetwork`` pods are not subject to NetworkPolicy (their ports are the node's), and as sources they are
  their node's address: pod and namespace selectors never match them, an ``ipBlock`` of the node's address does.

Strict: fields it does not model (egress policies, SCTP/UDP subtleties aside from the protocol match) raise
instead of being ignored, so a policy shape the tests do not understand fails loudly. ``ipBlock`` peers match
only sources outside the cluster (an address, not a pod): whether they match pod IPs is left to the plugin.
"""

from __future__ import annotations

import ipaddress
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any


class UnmodelledPolicyError(ValueError):
    """The chart rendered something this evaluator does not judge (egress rules): the tests refuse it rather than
    call a flow allowed or denied without evaluating it. The chart renders ingress policies only."""


NAMESPACE_NAME_LABEL = "kubernetes.io/metadata.name"
_SELECTOR_KEYS = {"matchLabels", "matchExpressions"}
_PEER_KEYS = {"podSelector", "namespaceSelector", "ipBlock"}
DEFAULT_NODE_IP = ipaddress.IPv4Address("10.0.0.1")


@dataclass(frozen=True)
class Pod:
    """A pod as the policies see it: namespace, labels, named container ports."""

    name: str
    namespace: str
    labels: Mapping[str, str]
    ports: Mapping[str, int] = field(default_factory=dict)
    host_network: bool = False
    node_ip: ipaddress.IPv4Address = DEFAULT_NODE_IP  # the source address with host_network


Source = Pod | ipaddress.IPv4Address


def selects(selector: Mapping[str, Any], labels: Mapping[str, str]) -> bool:
    """Whether a LabelSelector matches ``labels`` (an empty selector matches everything)."""
    unknown = set(selector) - _SELECTOR_KEYS
    if unknown:
        raise ValueError(f"unknown LabelSelector fields {sorted(unknown)}")
    if any(labels.get(k) != v for k, v in (selector.get("matchLabels") or {}).items()):
        return False
    for expr in selector.get("matchExpressions") or []:
        key, op, values = expr["key"], expr["operator"], expr.get("values") or []
        if op == "In" and labels.get(key) not in values:
            return False
        if op == "NotIn" and key in labels and labels[key] in values:
            return False
        if op == "Exists" and key not in labels:
            return False
        if op == "DoesNotExist" and key in labels:
            return False
        if op not in ("In", "NotIn", "Exists", "DoesNotExist"):
            raise ValueError(f"unknown selector operator {op!r}")
    return True


@dataclass(frozen=True)
class Cluster:
    """Namespaces (name -> labels) and the NetworkPolicies in force."""

    namespaces: Mapping[str, Mapping[str, str]]
    policies: Sequence[Mapping[str, Any]]

    def namespace_labels(self, name: str) -> dict[str, str]:
        if name not in self.namespaces:
            raise KeyError(f"namespace {name!r} is not declared")
        return {**self.namespaces[name], NAMESPACE_NAME_LABEL: name}

    def ingress_policies(self, pod: Pod) -> list[Mapping[str, Any]]:
        """The policies that isolate ``pod`` for ingress."""
        out = []
        for policy in self.policies:
            spec = policy["spec"]
            types = spec.get("policyTypes") or (["Ingress", "Egress"] if "egress" in spec else ["Ingress"])
            if "Egress" in types or "egress" in spec:
                raise UnmodelledPolicyError(f"{policy['metadata']['name']}: egress policies are not evaluated")
            if policy["metadata"]["namespace"] == pod.namespace and selects(spec["podSelector"], pod.labels):
                out.append(policy)
        return out

    def allows(self, source: Source, dest: Pod, port: int | str, protocol: str = "TCP") -> bool:
        """Whether ``source`` may connect to ``dest`` on ``port`` (a number, or a name of ``dest``'s ports)."""
        number = dest.ports[port] if isinstance(port, str) else port
        if dest.host_network:
            return True
        policies = self.ingress_policies(dest)
        if not policies:
            return True
        for policy in policies:
            namespace = policy["metadata"]["namespace"]
            for rule in policy["spec"].get("ingress") or []:
                unknown = set(rule) - {"from", "ports"}
                if unknown:
                    raise ValueError(f"unknown ingress rule fields {sorted(unknown)}")
                if self._port_matches(rule.get("ports"), dest, number, protocol) and self._from_matches(
                    rule.get("from"), namespace, source
                ):
                    return True
        return False

    @staticmethod
    def _port_matches(ports: Iterable[Mapping[str, Any]] | None, dest: Pod, number: int, protocol: str) -> bool:
        entries = list(ports or [])
        if not entries:
            return True
        for entry in entries:
            if entry.get("protocol", "TCP") != protocol:
                continue
            port = entry.get("port")
            if port is None:
                return True
            if isinstance(port, str):
                if dest.ports.get(port) == number:
                    return True
            elif port <= number <= entry.get("endPort", port):
                return True
        return False

    def _from_matches(self, peers: Iterable[Mapping[str, Any]] | None, namespace: str, source: Source) -> bool:
        entries = list(peers or [])
        return not entries or any(self._peer_matches(peer, namespace, source) for peer in entries)

    def _peer_matches(self, peer: Mapping[str, Any], namespace: str, source: Source) -> bool:
        unknown = set(peer) - _PEER_KEYS
        if unknown or not peer:
            raise ValueError(f"bad NetworkPolicyPeer {dict(peer)}")
        if isinstance(source, Pod) and source.host_network:
            source = source.node_ip
        if "ipBlock" in peer:
            if not isinstance(source, ipaddress.IPv4Address):
                return False
            block = peer["ipBlock"]
            excepted = any(source in ipaddress.ip_network(cidr) for cidr in block.get("except") or [])
            return source in ipaddress.ip_network(block["cidr"]) and not excepted
        if not isinstance(source, Pod):
            return False
        if "namespaceSelector" in peer:
            if not selects(peer["namespaceSelector"], self.namespace_labels(source.namespace)):
                return False
        elif source.namespace != namespace:
            return False
        return selects(peer.get("podSelector") or {}, source.labels)


def network_policies(docs: Iterable[Mapping[str, Any]]) -> list[Mapping[str, Any]]:
    return [d for d in docs if d.get("kind") == "NetworkPolicy"]
