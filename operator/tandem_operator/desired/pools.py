"""The two PDPools of a PDCluster. Pure.

Replicas rule (see ``tandem_operator.api.pdcluster``): the pool is *created* with ``replicas`` from
``spec.<role>.groups``, and every later server-side apply by the operator **omits** ``spec.replicas``. So the
operator's field manager never owns the field after creation, ``kubectl scale`` and HPAs own it, and an apply can
neither reset a scale nor race one.
"""

from __future__ import annotations

from typing import Any

from tandem.registry import Role
from tandem_operator.api.common import API_VERSION
from tandem_operator.api.pdcluster import PDClusterSpec
from tandem_operator.desired.naming import COMMON_LABELS, ClusterRef, cluster_owner, pool_name, role_labels


def pool_manifest(cluster: ClusterRef, spec: PDClusterSpec, role: Role, *, create: bool) -> dict[str, Any]:
    """The role's PDPool: with ``replicas`` (the initial size) for a create, without it for an apply."""
    pool_spec: dict[str, Any] = {"clusterName": cluster.name, "role": role.value}
    if create:
        pool_spec["replicas"] = spec.role(role).groups
    return {
        "apiVersion": API_VERSION,
        "kind": "PDPool",
        "metadata": {
            "name": pool_name(cluster.name, role),
            "namespace": cluster.namespace,
            "labels": {**COMMON_LABELS, **role_labels(cluster.name, role)},
            "ownerReferences": [cluster_owner(cluster).to_manifest()],
        },
        "spec": pool_spec,
    }


def pool_manifests(cluster: ClusterRef, spec: PDClusterSpec, existing: frozenset[Role]) -> list[dict[str, Any]]:
    """Both pools; those in ``existing`` in apply form, the others in create form."""
    return [pool_manifest(cluster, spec, role, create=role not in existing) for role in Role]
