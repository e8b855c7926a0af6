"""The router's OpenAPI 3.1 document, generated from the pydantic request models (the single source of truth),
served at ``/openapi.json`` so clients and fuzzers (schemathesis) see exactly what is validated."""

from __future__ import annotations

from typing import Any

from pydantic import BaseModel
from pydantic.json_schema import JsonSchemaMode, models_json_schema

from tandem import __version__
from tandem_router.openai.schema import ROUTES, ErrorResponse, ModelList, Route

_SUMMARIES = {
    Route.CHAT: "OpenAI chat completion (stream with SSE when stream=true)",
    Route.COMPLETIONS: "OpenAI text completion (a list prompt is a batch)",
    Route.GENERATE: "SGLang native generation",
}


def document(title: str = "Tandem router", version: str = __version__) -> dict[str, Any]:
    models: list[tuple[type[BaseModel], JsonSchemaMode]] = [(f.model, "validation") for f in ROUTES.values()]
    models += [
        (ErrorResponse, "serialization"),
        (ModelList, "serialization"),
    ]
    refs, defs = models_json_schema(models, ref_template="#/components/schemas/{model}")
    error = {"application/json": {"schema": refs[(ErrorResponse, "serialization")]}}
    errors = {
        str(code): {"description": text, "content": error}
        for code, text in (
            (400, "invalid request"),
            (401, "missing or wrong API key"),
            (404, "unknown model"),
            (413, "body too large"),
            (429, "too many concurrent requests"),
            (503, "no healthy pair"),
        )
    }
    paths: dict[str, Any] = {}
    for route, fields in ROUTES.items():
        paths[route.value] = {
            "post": {
                "summary": _SUMMARIES[route],
                "operationId": route.name.lower(),
                "requestBody": {
                    "required": True,
                    "content": {"application/json": {"schema": refs[(fields.model, "validation")]}},
                },
                "responses": {
                    "200": {
                        "description": "the decode worker's response (JSON, or text/event-stream when streaming)",
                        "content": {
                            "application/json": {"schema": {"type": "object"}},
                            "text/event-stream": {"schema": {"type": "string"}},
                        },
                    },
                    **errors,
                },
            }
        }
    paths["/v1/models"] = {
        "get": {
            "summary": "served models",
            "operationId": "models",
            "responses": {
                "200": {
                    "description": "models",
                    "content": {"application/json": {"schema": refs[(ModelList, "serialization")]}},
                },
                "401": errors["401"],
            },
        }
    }
    for path, text in (("/health", "liveness"), ("/readiness", "at least one healthy prefill/decode pair")):
        paths[path] = {
            "get": {
                "summary": text,
                "operationId": path.strip("/"),
                "responses": {"200": {"description": "ok"}, "503": {"description": "not ready"}},
            }
        }
    return {
        "openapi": "3.1.0",
        "info": {"title": title, "version": version},
        "paths": paths,
        "components": {
            "schemas": defs.get("$defs", {}),
            "securitySchemes": {"bearer": {"type": "http", "scheme": "bearer"}},
        },
    }
