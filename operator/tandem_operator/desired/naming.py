"""Names, labels and revision hashes of everything the operator creates. Pure."""

from __future__ import annotations

import hashlib
import json
from collections.abc import Mapping, Sequence
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
# The PDCluster's metadata.generation, and the template hash the operator wanted then, when the group's pods were
# last looked at (upgrade.py: was a change of rendering the user's, or the operator's?).
ANNOTATION_GENERATION = f"{GROUP}/generation"
ANNOTATION_DESIRED_HASH = f"{GROUP}/desired-template-hash"
ANNOTATION_FENCED = f"{GROUP}/fenced"  # on a group's Service: "<epoch>/<reason>" of the last fenced incarnation
# Where an incarnation's weights come from (spec.peerLoading): "node", or "peer" with the seed in
# ANNOTATION_WEIGHT_SEED ("<seed group>/<seed epoch>"); chosen per incarnation, so neither is hashed.
ANNOTATION_WEIGHT_SOURCE = f"{GROUP}/weight-source"
ANNOTATION_WEIGHT_SEED = f"{GROUP}/weight-seed"
# On a group's Service: the epoch of an incarnation that died loading from a peer (its successor reads the node's).
ANNOTATION_PEER_LOAD_FAILED = f"{GROUP}/peer-load-failed"
# The init container that stages the weights in the node's copy (model.weightCache.prefetch), and the node label the
# operator sets once it finished there: ``weights.tandem.dev/<digest of what it staged and where>=staged``.
PREFETCH_CONTAINER = "prefetch-weights"
STAGED_LABEL_PREFIX = f"weights.{GROUP}/"
STAGED_VALUE = "staged"
# The staging Jobs of model.weightCache.stageNodes (desired/staging_jobs.py): labelled with the cluster and this
# component (their pods carry no cluster label: they are no workers), annotated with the node they stage.
LABEL_COMPONENT = "app.kubernetes.io/component"
STAGING_COMPONENT = "weight-staging"
ANNOTATION_STAGED_NODE = f"{GROUP}/node"
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
    """The model as it reaches the workers: cachedNodeLabel is only a scheduling preference of new pods, and
    weightCache.stageNodes only whether Jobs stage the nodes ahead of them (both came later, and setting or
    changing them rolls nothing)."""
    model = {k: v for k, v in wire["model"].items() if k != "cachedNodeLabel"}
    if "weightCache" in model:
        model["weightCache"] = {k: v for k, v in model["weightCache"].items() if k != "stageNodes"}
    return model


def staged_label(spec: PDClusterSpec) -> str | None:
    """The node label of a node whose prefetch of this model finished (None without ``weightCache.prefetch``).

    One label per staged copy: the repo and revision the completion marker names, and the node directory it lies
    in (two clusters of one model with different ``hostPath`` stage two copies). A sha256 prefix keeps the key's
    name a valid label name (63 characters at most) whatever the repo is called.
    """
    cache = spec.model.weight_cache
    if cache is None or not cache.prefetch:
        return None
    staged = f"{cache.repo}@{spec.model.revision or 'default'}:{cache.host_path}:{spec.model.path}"
    return STAGED_LABEL_PREFIX + hashlib.sha256(staged.encode()).hexdigest()[:20]


# What a pod carries that is no input of what it runs: the revision hash itself, and per-incarnation stamps.
_UNHASHED_LABELS = frozenset({LABEL_TEMPLATE_HASH})
_UNHASHED_ANNOTATIONS = frozenset(
    {ANNOTATION_EPOCH, ANNOTATION_GENERATION, ANNOTATION_DESIRED_HASH, ANNOTATION_WEIGHT_SOURCE, ANNOTATION_WEIGHT_SEED}
)


_PREFERRED = "preferredDuringSchedulingIgnoredDuringExecution"


def canonical_pod(pod: Mapping[str, Any]) -> dict[str, Any]:
    """A pod manifest without what differs between two renderings of the same thing: its name, namespace and owner
    (the PDPool's uid changes when the pool is recreated), its template hash and its incarnation stamps; and
    without preferred (anti-)affinity terms: a preference only ranks nodes for the pods created from then on, a pod
    placed without it runs the same (``model.cachedNodeLabel``). Everything else the kubelet runs from (the pod
    spec) and the labels and annotations the pod carries stay."""
    metadata = pod.get("metadata") or {}
    labels = {k: v for k, v in (metadata.get("labels") or {}).items() if k not in _UNHASHED_LABELS}
    annotations = {k: v for k, v in (metadata.get("annotations") or {}).items() if k not in _UNHASHED_ANNOTATIONS}
    spec = dict(pod.get("spec") or {})
    if "affinity" in spec:
        kinds = {kind: {k: v for k, v in terms.items() if k != _PREFERRED} for kind, terms in spec["affinity"].items()}
        spec["affinity"] = {kind: terms for kind, terms in kinds.items() if terms}
    return {"metadata": {"labels": labels, "annotations": annotations}, "spec": spec}


def template_hash(pods: Sequence[Mapping[str, Any]]) -> str:
    """The revision of a role's pods: a hash of its canonical group's pods as rendered (every rank of group 0 at
    epoch 0, ``pods.revision_pods``), canonicalized. Whatever changes what the pods run rolls the role's groups,
    a change of the spec or of the operator's rendering alike; a new spec field, defaulted, rolls nothing unless
    it renders differently. ``upgrade.py`` decides when a change of rendering alone may roll."""
    return _digest([canonical_pod(pod) for pod in pods])
