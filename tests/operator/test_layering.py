"""Import layering of tandem_operator, checked from the source (an import-linter-style contract).

handlers/adapters (k8s) -> desired | status | planner | crd -> api. The pure layers import no I/O library.
"""

from __future__ import annotations

import ast
from pathlib import Path

import pytest

import tandem_operator

ROOT = Path(tandem_operator.__file__).parent
IO_LIBRARIES = {"kopf", "kubernetes_asyncio", "aiohttp", "aetcd", "asyncio", "socket", "subprocess", "requests"}
# layer -> tandem_operator layers it may import
ALLOWED = {
    "api": {"api"},
    "crd": {"api", "crd"},
    "desired": {"api", "desired"},
    "status": {"api", "desired", "status"},
    "planner": {"status", "planner"},
    "crdgen": {"crd"},
    "fencing": {"api", "desired", "status", "fencing"},
    "registration": {"api", "desired", "status", "fencing", "registration"},
    "recovery": {"desired", "status", "fencing", "recovery"},
    "leader": {"leader"},
    "integrity": {"api", "status", "integrity"},
}


def layer_of(path: Path) -> str:
    rel = path.relative_to(ROOT)
    return rel.parts[0] if len(rel.parts) > 1 else rel.stem


def imports(path: Path) -> set[str]:
    found: set[str] = set()
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.Import):
            found |= {alias.name for alias in node.names}
        elif isinstance(node, ast.ImportFrom) and node.module and node.level == 0:
            found.add(node.module)
    return found


MODULES = sorted(p for p in ROOT.rglob("*.py") if layer_of(p) in ALLOWED)


def test_pure_layers_exist() -> None:
    assert {layer_of(p) for p in MODULES} == set(ALLOWED)


@pytest.mark.parametrize("path", MODULES, ids=lambda p: str(p.relative_to(ROOT)))
def test_layer_imports(path: Path) -> None:
    layer = layer_of(path)
    for name in imports(path):
        top = name.split(".")[0]
        assert top not in IO_LIBRARIES, f"{path.name}: pure layer {layer!r} imports {name}"
        if top == "tandem_operator":
            target = name.split(".")[1] if "." in name else ""
            assert target in ALLOWED[layer], f"{path.name}: layer {layer!r} may not import {name}"
        if top == "tandem":
            assert name == "tandem.registry", f"{path.name}: {name} (only the shared registry schema is allowed)"
