"""pydantic model -> Kubernetes structural OpenAPI v3 schema. Pure: no I/O.

pydantic emits JSON Schema 2020-12; the API server wants a *structural* schema (every node typed, no ``$ref``, no
``anyOf`` except under int-or-string, ``nullable`` instead of ``null`` unions, no ``additionalProperties`` next to
``properties``). This converter:

* inlines ``$ref`` (``$defs``), keeping the referring field's ``description``;
* turns ``Optional[X]`` (``anyOf: [X, {type: null}]``) into ``X`` with ``nullable: true`` and drops null defaults;
* turns ``const`` into a one-value ``enum`` and 2020-12 numeric ``exclusiveMinimum: n`` into OpenAPI 3.0's
  ``minimum: n, exclusiveMinimum: true``;
* drops ``title`` and ``additionalProperties: false`` (the API server prunes unknown fields anyway);
* gives optional object fields whose own fields are all optional a default made of their fields' defaults, so the
  API server fills in nested defaults (pydantic does not render ``default_factory`` defaults) and the default
  passes the object's CEL rules;
* rejects any keyword it does not know, so a new pydantic feature cannot slip an invalid schema into a CRD.
"""

from __future__ import annotations

import copy
from typing import Any

from pydantic import BaseModel

Schema = dict[str, Any]

_PASSTHROUGH = frozenset(
    {
        "type",
        "description",
        "default",
        "enum",
        "format",
        "minimum",
        "maximum",
        "minLength",
        "maxLength",
        "pattern",
        "minItems",
        "maxItems",
        "minProperties",
        "maxProperties",
        "required",
        "nullable",
        "x-kubernetes-int-or-string",
        "x-kubernetes-validations",
        "x-kubernetes-preserve-unknown-fields",
        "x-kubernetes-list-type",
        "x-kubernetes-list-map-keys",
    }
)
_DROPPED = frozenset({"title"})


class SchemaError(ValueError):
    """The model uses a JSON Schema construct that has no structural-schema equivalent."""


def structural_schema(model: type[BaseModel]) -> Schema:
    """The structural schema of ``model`` as its CRD wire form (camelCase aliases, validation mode)."""
    raw = model.model_json_schema(by_alias=True, mode="validation")
    defs: dict[str, Schema] = raw.pop("$defs", {})
    return _convert(raw, defs, path=model.__name__)


def _resolve(node: Schema, defs: dict[str, Schema], path: str) -> Schema:
    """Inline a ``$ref`` (or a one-element ``allOf`` of one); sibling keys win over the referenced ones."""
    node = dict(node)
    if "allOf" in node:
        parts = node.pop("allOf")
        if len(parts) != 1:
            raise SchemaError(f"{path}: allOf with {len(parts)} parts is not supported")
        node = {**parts[0], **node}
    ref = node.pop("$ref", None)
    if ref is None:
        return node
    name = ref.removeprefix("#/$defs/")
    if name not in defs:
        raise SchemaError(f"{path}: unresolvable $ref {ref}")
    return {**copy.deepcopy(defs[name]), **node}


def _convert(node: Schema, defs: dict[str, Schema], path: str) -> Schema:
    node = _resolve(node, defs, path)
    nullable = False
    if "anyOf" in node:
        options = [o for o in node.pop("anyOf") if o != {"type": "null"}]
        nullable = True
        if len(options) != 1:
            if node.get("x-kubernetes-int-or-string"):
                options = [{}]
            else:
                raise SchemaError(f"{path}: anyOf of {len(options)} types is not structural")
        node = {**_resolve(options[0], defs, path), **node}
        if node.get("default", ...) is None:
            del node["default"]
    if "const" in node:
        node["enum"] = [node.pop("const")]
    if node.get("additionalProperties") is False:
        del node["additionalProperties"]
    out: Schema = {}
    for key, value in node.items():
        if key in _DROPPED:
            continue
        if key == "properties":
            out[key] = {name: _convert(sub, defs, f"{path}.{name}") for name, sub in value.items()}
        elif key in ("items", "additionalProperties"):
            out[key] = _convert(value, defs, f"{path}[]")
        elif key in ("exclusiveMinimum", "exclusiveMaximum"):
            out["minimum" if key == "exclusiveMinimum" else "maximum"] = value
            out[key] = True
        elif key in _PASSTHROUGH:
            out[key] = value
        else:
            raise SchemaError(f"{path}: unsupported JSON Schema keyword {key!r}")
    if nullable:
        out["nullable"] = True
    if "enum" in out and "type" not in out:
        out["type"] = "string"
    if "x-kubernetes-int-or-string" in out:
        out.pop("type", None)
    if out.get("type") == "object" and "properties" in out:
        _default_nested_objects(out)
    return out


def _default_nested_objects(obj: Schema) -> None:
    required = set(obj.get("required", ()))
    for name, prop in obj["properties"].items():
        if name in required or "default" in prop or prop.get("nullable") or prop.get("type") != "object":
            continue
        if "properties" in prop and not prop.get("required"):
            # The API server checks a default against the object's CEL rules *without* filling in nested
            # defaults first, so an empty default fails rules that read fields ("no such key"): spell them out.
            prop["default"] = {key: sub["default"] for key, sub in prop["properties"].items() if "default" in sub}
