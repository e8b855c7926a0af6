"""Placement of a group inside one RDMA fabric domain (``spec.fabric``), and a node's domain. Pure.

Every rank of a group, the leader included, gets one required pod-affinity term: the group's pods (its labels,
any rank) with the topology key ``fabric.domainLabel``. The scheduler places the first pod of a group on any node
that has the label (a pod whose term matches only itself may start a series; a node without the topology key
never satisfies a term) and every other rank in that pod's domain, whichever rank comes first. So every pod of
every group sits on a labelled node, and the registry always gets a domain for a group (``node_domain``).
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

from tandem_operator.api.pdcluster import PDClusterSpec


def fabric_affinity_terms(spec: PDClusterSpec, group_labels: Mapping[str, str]) -> list[dict[str, Any]]:
    """The required pod-affinity terms that keep a group (``group_labels``: its pods, any rank) in one domain;
    none without ``spec.fabric``."""
    if spec.fabric is None:
        return []
    return [{"labelSelector": {"matchLabels": dict(group_labels)}, "topologyKey": spec.fabric.domain_label}]


def node_domain(node: Mapping[str, Any] | None, label: str) -> str | None:
    """The fabric domain of a node (its ``label`` value); None for a node that is gone, unlabelled, or labelled
    with an empty value."""
    labels = ((node or {}).get("metadata") or {}).get("labels") or {}
    value = labels.get(label)
    return value if isinstance(value, str) and value else None
