"""Server-side apply with the ``tandem-operator`` field manager, and plain creates.

``apply_request`` / ``create_request`` are pure (tested without a cluster); ``tandem.kube.rest.RestClient`` sends a
``Request`` (``kube.Kube`` maps its errors and retries). Apply always forces: the operator is
the only writer of the fields it applies (pool replicas excepted: they are never in an apply, see
``desired.pools``), so a conflict means a human edited a managed field and the spec must win.
"""

from __future__ import annotations

from typing import Any

from tandem.kube.rest import Request
from tandem_operator.api.common import API_VERSION
from tandem_operator.desired.naming import FIELD_MANAGER

# The manager of the initial PDPool replicas (a create, never an apply): see tandem_operator.desired.pools.
INITIAL_SIZE_MANAGER = "tandem-operator-initial-size"
APPLY_CONTENT_TYPE = "application/apply-patch+yaml"  # JSON is YAML: the body is sent as JSON

PLURALS: dict[tuple[str, str], str] = {
    ("v1", "Pod"): "pods",
    ("v1", "Service"): "services",
    ("v1", "Event"): "events",
    ("events.k8s.io/v1", "Event"): "events",
    ("coordination.k8s.io/v1", "Lease"): "leases",
    ("policy/v1", "PodDisruptionBudget"): "poddisruptionbudgets",
    ("batch/v1", "Job"): "jobs",
    ("scheduling.volcano.sh/v1beta1", "PodGroup"): "podgroups",
    ("scheduling.x-k8s.io/v1alpha1", "PodGroup"): "podgroups",
    (API_VERSION, "PDCluster"): "pdclusters",
    (API_VERSION, "PDPool"): "pdpools",
}


def collection_path(api_version: str, kind: str, namespace: str) -> str:
    try:
        plural = PLURALS[(api_version, kind)]
    except KeyError:
        raise ValueError(f"no REST path known for {api_version} {kind}") from None
    prefix = "/api/v1" if api_version == "v1" else f"/apis/{api_version}"
    return f"{prefix}/namespaces/{namespace}/{plural}"


def object_path(manifest: dict[str, Any], subresource: str | None = None) -> str:
    metadata = manifest["metadata"]
    path = f"{collection_path(manifest['apiVersion'], manifest['kind'], metadata['namespace'])}/{metadata['name']}"
    return f"{path}/{subresource}" if subresource else path


def apply_request(manifest: dict[str, Any], *, subresource: str | None = None, force: bool = True) -> Request:
    """PATCH (apply) of ``manifest``; ``subresource="status"`` applies only its ``status``."""
    query = [("fieldManager", FIELD_MANAGER)]
    if force:
        query.append(("force", "true"))
    return Request(
        "PATCH", object_path(manifest, subresource), tuple(query), {"Content-Type": APPLY_CONTENT_TYPE}, manifest
    )


def create_request(manifest: dict[str, Any], *, field_manager: str = FIELD_MANAGER) -> Request:
    metadata = manifest["metadata"]
    path = collection_path(manifest["apiVersion"], manifest["kind"], metadata["namespace"])
    return Request("POST", path, (("fieldManager", field_manager),), {"Content-Type": "application/json"}, manifest)
