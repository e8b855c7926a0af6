"""The import contracts in pyproject.toml [tool.importlinter] hold (router, operator and simulator layers; pure
layers import no HTTP, etcd or Kubernetes client), and the layers contracts name every module of those packages:
a module no layer names is under no rule, so a new one must be placed (the simulator's layers contracts are
exhaustive themselves: import-linter breaks them on a module they leave out)."""

from __future__ import annotations

import re
import subprocess
import sys
import tomllib
from pathlib import Path

import grimp
import pytest

ROOT = Path(__file__).resolve().parents[1]
LAYERED = ("tandem_router", "tandem_operator")


def test_import_contracts_are_kept() -> None:
    lint_imports = Path(sys.executable).with_name("lint-imports")
    result = subprocess.run([str(lint_imports), "--no-cache"], cwd=ROOT, capture_output=True, text=True, timeout=120)
    assert result.returncode == 0, result.stdout + result.stderr
    assert "0 broken" in result.stdout


def layered_names() -> set[str]:
    """Every module or package a layers contract names (a package covers what is under it)."""
    config = tomllib.loads((ROOT / "pyproject.toml").read_text())
    names: set[str] = set()
    for contract in config["tool"]["importlinter"]["contracts"]:
        if contract["type"] == "layers":
            for layer in contract["layers"]:
                names.update(name.strip() for name in re.split(r"[|:]", layer))
    return names


@pytest.mark.parametrize("package", LAYERED)
def test_the_layers_name_every_module(package: str) -> None:
    names = layered_names()
    graph = grimp.build_graph(package)
    modules = {m for m in graph.modules if m.startswith(package + ".")}

    def covered(module: str) -> bool:
        parts = module.split(".")
        return any(".".join(parts[:i]) in names for i in range(2, len(parts) + 1))

    def container(module: str) -> bool:  # a package whose own __init__ holds nothing but what is under it
        return any(n.startswith(module + ".") for n in names) and not graph.find_modules_directly_imported_by(module)

    unplaced = sorted(m for m in modules if not covered(m) and not container(m))
    assert unplaced == [], f"modules no layers contract in pyproject.toml names: {unplaced}"
