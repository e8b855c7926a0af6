"""The pydantic -> structural schema converter (golden) and the generated CRDs."""

from __future__ import annotations

import re
from enum import StrEnum
from typing import Any, Literal

import pytest
from pydantic import BaseModel, Field

from tandem_operator import crdgen
from tandem_operator.api.common import Quantity
from tandem_operator.api.rules import CrdModel, Rule
from tandem_operator.crd.build import all_crds
from tandem_operator.crd.schema import SchemaError, structural_schema


class Color(StrEnum):
    RED = "red"
    BLUE = "blue"


class Inner(CrdModel):
    """Inner doc."""

    size: int = Field(default=3, ge=1)


class Needy(CrdModel):
    name: str


class Sample(CrdModel):
    """Sample doc."""

    color: Color = Color.RED
    inner: Inner = Field(default_factory=Inner, description="the inner")
    needy: Needy
    maybe: Inner | None = None
    note: str | None = Field(default=None, max_length=5)
    backend: Literal["mooncake"] | None = None
    qty: Quantity = "1Gi"
    ratio: float = Field(default=0.5, gt=0, lt=1)
    tags: list[str] = Field(default_factory=list, max_length=2)
    labels: dict[str, str] = Field(default_factory=dict)

    cel_rules = (Rule(cel="self.inner.size > 0", message="inner must be positive", check=lambda s: True),)


def test_structural_schema_golden() -> None:
    assert structural_schema(Sample) == {
        "description": "Sample doc.",
        "type": "object",
        "required": ["needy"],
        "x-kubernetes-validations": [{"rule": "self.inner.size > 0", "message": "inner must be positive"}],
        "properties": {
            "color": {"enum": ["red", "blue"], "type": "string", "default": "red"},
            "inner": {
                "description": "the inner",
                "type": "object",
                "properties": {"size": {"default": 3, "minimum": 1, "type": "integer"}},
                "default": {"size": 3},  # spelled out: the API server checks defaults against CEL rules
            },
            "needy": {"type": "object", "properties": {"name": {"type": "string"}}, "required": ["name"]},
            "maybe": {
                "description": "Inner doc.",
                "type": "object",
                "properties": {"size": {"default": 3, "minimum": 1, "type": "integer"}},
                "nullable": True,
            },
            "note": {"type": "string", "maxLength": 5, "nullable": True},
            "backend": {"enum": ["mooncake"], "type": "string", "nullable": True},
            "qty": {"default": "1Gi", "x-kubernetes-int-or-string": True},
            "ratio": {
                "default": 0.5,
                "minimum": 0,
                "exclusiveMinimum": True,
                "maximum": 1,
                "exclusiveMaximum": True,
                "type": "number",
            },
            "tags": {"items": {"type": "string"}, "maxItems": 2, "type": "array"},
            "labels": {"additionalProperties": {"type": "string"}, "type": "object"},
        },
    }


def test_unsupported_keyword_is_an_error() -> None:
    class Tuple(BaseModel):
        pair: tuple[int, str]

    with pytest.raises(SchemaError, match=r"Tuple\.pair: unsupported JSON Schema keyword 'prefixItems'"):
        structural_schema(Tuple)


def test_non_structural_union_is_an_error() -> None:
    class Union(BaseModel):
        either: int | str

    with pytest.raises(SchemaError, match=r"Union\.either: anyOf of 2 types"):
        structural_schema(Union)


def _walk(node: Any, path: str = "") -> list[tuple[str, dict[str, Any]]]:
    found: list[tuple[str, dict[str, Any]]] = []
    if isinstance(node, dict):
        found.append((path, node))
        for key, value in node.items():
            found += _walk(value, f"{path}/{key}")
    elif isinstance(node, list):
        for i, value in enumerate(node):
            found += _walk(value, f"{path}/{i}")
    return found


@pytest.mark.parametrize("crd", all_crds(), ids=lambda c: c["metadata"]["name"])
def test_generated_crd_is_structural(crd: dict[str, Any]) -> None:
    schema = crd["spec"]["versions"][0]["schema"]["openAPIV3Schema"]
    for path, node in _walk(schema):
        assert not {"$ref", "anyOf", "allOf", "title", "$defs", "const"} & node.keys(), path
        if path.endswith(("/properties", "/default")) or "/x-kubernetes-validations" in path:
            continue
        if "/default/" in path:
            continue
        assert "type" in node or node.get("x-kubernetes-int-or-string"), f"untyped node at {path}"


def _resolve_cel_path(schema: dict[str, Any], dotted: str) -> bool:
    node = schema
    for part in dotted.split("."):
        props = node.get("properties", {})
        if part not in props:
            return False
        node = props[part]
    return True


@pytest.mark.parametrize("crd", all_crds(), ids=lambda c: c["metadata"]["name"])
def test_every_cel_rule_names_existing_fields(crd: dict[str, Any]) -> None:
    """CEL is only compiled by the API server; at least check that each ``self.a.b`` is a field of the node."""
    schema = crd["spec"]["versions"][0]["schema"]["openAPIV3Schema"]
    checked = 0
    for path, node in _walk(schema):
        for rule in node.get("x-kubernetes-validations", []):
            for match in re.finditer(r"\bself((?:\.[A-Za-z_]\w*)+)", rule["rule"]):
                parts = match.group(1).lstrip(".").split(".")
                if rule["rule"][match.end() : match.end() + 1] == "(":
                    parts.pop()  # a method call (size, all, startsWith), not a field
                dotted = ".".join(parts)
                if not dotted or dotted.startswith("metadata."):
                    continue
                assert _resolve_cel_path(node, dotted), f"{path}: {rule['rule']!r} names unknown field {dotted}"
                checked += 1
            if "fieldPath" in rule:
                assert _resolve_cel_path(node, rule["fieldPath"].lstrip(".")), f"{path}: fieldPath {rule}"
    if crd["spec"]["names"]["kind"] == "PDCluster":
        assert checked >= 20


def test_pdpool_has_scale_and_status_subresources() -> None:
    pool = next(c for c in all_crds() if c["spec"]["names"]["kind"] == "PDPool")
    version = pool["spec"]["versions"][0]
    assert version["subresources"] == {
        "status": {},
        "scale": {
            "specReplicasPath": ".spec.replicas",
            "statusReplicasPath": ".status.replicas",
            "labelSelectorPath": ".status.labelSelector",
        },
    }
    assert pool["spec"]["names"]["shortNames"] == ["pdp"]


def test_pdcluster_printer_columns() -> None:
    cluster = next(c for c in all_crds() if c["spec"]["names"]["kind"] == "PDCluster")
    version = cluster["spec"]["versions"][0]
    assert [(c["name"], c["jsonPath"]) for c in version["additionalPrinterColumns"]] == [
        ("Prefill", ".status.prefill.readyGroups"),
        ("Decode", ".status.decode.readyGroups"),
        ("Phase", ".status.phase"),
        ("Revision", ".status.revision"),
        ("Age", ".metadata.creationTimestamp"),
    ]
    assert version["subresources"] == {"status": {}}
    assert cluster["spec"]["names"]["shortNames"] == ["pdc"]


def test_committed_crds_match_the_models() -> None:
    for name, text in crdgen.rendered_files().items():
        path = crdgen.DEFAULT_DIR / name
        assert path.read_text() == text, f"{path} is stale: run make generate"
