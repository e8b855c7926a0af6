"""The two CustomResourceDefinitions, as data. Pure: ``python -m tandem_operator.crdgen`` writes them."""

from __future__ import annotations

from typing import Any

from pydantic import BaseModel

from tandem_operator.api.common import GROUP, VERSION
from tandem_operator.api.pdcluster import CLUSTER_NAME_RULES, PDClusterSpec, PDClusterStatus
from tandem_operator.api.pdpool import PDPoolSpec, PDPoolStatus
from tandem_operator.crd.schema import Schema, structural_schema


def _object_schema(spec: type[BaseModel], status: type[BaseModel], description: str) -> Schema:
    return {
        "type": "object",
        "description": description,
        "required": ["spec"],
        "properties": {
            "apiVersion": {"type": "string"},
            "kind": {"type": "string"},
            "metadata": {"type": "object"},
            "spec": structural_schema(spec),
            "status": structural_schema(status),
        },
    }


def _crd(
    *,
    kind: str,
    plural: str,
    short: str,
    schema: Schema,
    columns: list[dict[str, Any]],
    subresources: dict[str, Any],
) -> dict[str, Any]:
    return {
        "apiVersion": "apiextensions.k8s.io/v1",
        "kind": "CustomResourceDefinition",
        "metadata": {
            "name": f"{plural}.{GROUP}",
            "labels": {"app.kubernetes.io/name": "tandem", "app.kubernetes.io/component": "crd"},
        },
        "spec": {
            "group": GROUP,
            "names": {
                "kind": kind,
                "listKind": f"{kind}List",
                "plural": plural,
                "singular": kind.lower(),
                "shortNames": [short],
                "categories": ["tandem"],
            },
            "scope": "Namespaced",
            "versions": [
                {
                    "name": VERSION,
                    "served": True,
                    "storage": True,
                    "schema": {"openAPIV3Schema": schema},
                    "subresources": subresources,
                    "additionalPrinterColumns": columns,
                }
            ],
        },
    }


def _age() -> dict[str, str]:
    return {"name": "Age", "type": "date", "jsonPath": ".metadata.creationTimestamp"}


def pdcluster_crd() -> dict[str, Any]:
    schema = _object_schema(
        PDClusterSpec,
        PDClusterStatus,
        "A prefill/decode-disaggregated SGLang deployment (Mooncake KV transfer) reconciled by tandem-operator.",
    )
    schema["x-kubernetes-validations"] = [rule.to_schema() for rule in CLUSTER_NAME_RULES]
    columns: list[dict[str, Any]] = [
        {"name": "Prefill", "type": "integer", "jsonPath": ".status.prefill.readyGroups",
         "description": "Ready prefill groups"},
        {"name": "Decode", "type": "integer", "jsonPath": ".status.decode.readyGroups",
         "description": "Ready decode groups"},
        {"name": "Phase", "type": "string", "jsonPath": ".status.phase"},
        {"name": "Revision", "type": "string", "jsonPath": ".status.revision", "priority": 1},
        _age(),
    ]  # fmt: skip
    return _crd(
        kind="PDCluster",
        plural="pdclusters",
        short="pdc",
        schema=schema,
        columns=columns,
        subresources={"status": {}},
    )


def pdpool_crd() -> dict[str, Any]:
    schema = _object_schema(PDPoolSpec, PDPoolStatus, "One role (prefill or decode) of a PDCluster; scale it.")
    columns: list[dict[str, Any]] = [
        {"name": "Cluster", "type": "string", "jsonPath": ".spec.clusterName"},
        {"name": "Role", "type": "string", "jsonPath": ".spec.role"},
        {"name": "Desired", "type": "integer", "jsonPath": ".spec.replicas", "description": "Desired groups"},
        {"name": "Ready", "type": "integer", "jsonPath": ".status.readyReplicas", "description": "Ready groups"},
        {"name": "Up-to-date", "type": "integer", "jsonPath": ".status.updatedReplicas"},
        _age(),
    ]
    scale = {
        "specReplicasPath": ".spec.replicas",
        "statusReplicasPath": ".status.replicas",
        "labelSelectorPath": ".status.labelSelector",
    }
    return _crd(
        kind="PDPool",
        plural="pdpools",
        short="pdp",
        schema=schema,
        columns=columns,
        subresources={"status": {}, "scale": scale},
    )


def all_crds() -> list[dict[str, Any]]:
    return [pdcluster_crd(), pdpool_crd()]
