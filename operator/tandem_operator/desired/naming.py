"""Names, labels and revision hashes of everything the operator creates. Pure."""

from __future__ import annotations

import hashlib
import json
from dataclasses import dataclass
from typing import Any

from tandem.registry import Role
from tandem_operator.api.common import API_VERSION, GROUP
from tandem_operator.api.pdcluster import PDClusterSpec

FIELD_MANAGER = "tandem-operator"

LABEL_CLUSTER = f"{GROUP}/cluster"
LABEL_ROLE = f"{GROUP}/role"
LABEL_GROUP = f"{GROUP}/group"
LABEL_RANK = f"{GROUP}/rank"
LABEL_REVISION = f"{GROUP}/revision"
LABEL_TEMPLATE_HASH = f"{GROUP}/template-hash"
ANNOTATION_BOOTSTRAP_PORT = "sglang.ai/bootstrap-port"
# Incarnation of a group: bumped each time the group is recreated after a member died (pods and Service carry it).
ANNOTATION_EPOCH = f"{GROUP}/epoch"
ANNOTATION_FENCED = f"{GROUP}/fenced"  # on a group's Service: "<epoch>/<reason>" of the last fenced incarnation
COMMON_LABELS = {"app.kubernetes.io/name": "tandem-worker", "app.kubernetes.io/managed-by": FIELD_MANAGER}


@dataclass(frozen=True)
class ClusterRef:
    """The identity of a PDCluster object (its spec travels separately)."""

    name: str
    namespace: str
    uid: str


@dataclass(frozen=True)
class OwnerRef:
    """An object that owns (and garbage-collects) the manifests generated for it."""

    api_version: str
    kind: str
    name: str
    uid: str

    def to_manifest(self) -> dict[str, Any]:
        return {
            "apiVersion": self.api_version,
            "kind": self.kind,
            "name": self.name,
            "uid": self.uid,
            "controller": True,
            "blockOwnerDeletion": True,
        }


def cluster_owner(cluster: ClusterRef) -> OwnerRef:
    return OwnerRef(API_VERSION, "PDCluster", cluster.name, cluster.uid)


def mooncake_cluster_id(cluster: ClusterRef) -> str:
    """MC_METADATA_CLUSTER_ID: Mooncake's etcd keys of this cluster live under ``mooncake/<id>/``."""
    return f"{cluster.namespace}.{cluster.name}"


def pool_name(cluster: str, role: Role) -> str:
    return f"{cluster}-{role.value}"


def group_name(cluster: str, role: Role, group: int) -> str:
    """Name of the group's headless Service, whose DNS name is the leader's stable address."""
    return f"{cluster}-{role.value}-{group}"


def pod_name(cluster: str, role: Role, group: int, rank: int) -> str:
    return f"{group_name(cluster, role, group)}-{rank}"


def role_labels(cluster: str, role: Role) -> dict[str, str]:
    return {LABEL_CLUSTER: cluster, LABEL_ROLE: role.value}


def group_labels(cluster: str, role: Role, group: int) -> dict[str, str]:
    return {**role_labels(cluster, role), LABEL_GROUP: str(group)}


def selector_string(labels: dict[str, str]) -> str:
    """A label selector in the string form of ``status.labelSelector`` (scale subresource)."""
    return ",".join(f"{key}={value}" for key, value in sorted(labels.items()))


def _digest(data: Any) -> str:
    return hashlib.sha256(json.dumps(data, sort_keys=True, separators=(",", ":")).encode()).hexdigest()[:10]


def compat_revision(spec: PDClusterSpec) -> str:
    """What a prefill and a decode must share to be paired: model, worker image, transfer protocol.

    It is the ``revision`` routers compare; a change rolls both roles, and during the roll routers pair old with
    old and new with new.
    """
    wire = spec.to_wire()
    return _digest({"model": _model(wire), "image": wire["images"]["worker"], "protocol": wire["transfer"]["protocol"]})


def _model(wire: dict[str, Any]) -> dict[str, Any]:
    """The model as it reaches the workers: cachedNodeLabel is only a scheduling preference of new pods (it came
    later, and setting or changing it rolls nothing)."""
    return {k: v for k, v in wire["model"].items() if k != "cachedNodeLabel"}


def template_hash(spec: PDClusterSpec, role: Role) -> str:
    """Hash of every input of the role's pods: a change rolls the role's groups. ``groups`` is excluded."""
    wire = spec.to_wire()
    role_spec = {key: value for key, value in wire[role.value].items() if key != "groups"}
    # fabric came later: hashed only when set, and only its placement (fabric.mode reaches routers, not pods)
    fabric = {"fabric": spec.fabric.domain_label} if spec.fabric is not None else {}
    return _digest(
        {
            **fabric,
            "role": role_spec,
            "model": _model(wire),
            "images": wire["images"],
            "transfer": wire["transfer"],
            # mooncakeEndpoints came later: hashed only when set, so upgrading the operator rolls no pod
            "etcd": {k: v for k, v in wire["etcd"].items() if k != "mooncakeEndpoints" or v},
            # nodeLostGraceSeconds is the operator's own timer, in no pod: it came later, and changes no pod
            "lifecycle": {k: v for k, v in wire["lifecycle"].items() if k != "nodeLostGraceSeconds"},
            "jitCache": wire["jitCache"],
            "scheduling": wire["scheduling"],
        }
    )
