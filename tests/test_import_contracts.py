"""The import contracts in pyproject.toml [tool.importlinter] hold (router, operator, simulator and dev tooling
layers; pure layers import no HTTP, etcd or Kubernetes client), and the layers contracts name every module of those
packages: a module no layer names is under no rule, so a new one must be placed (the simulator's and the dev
tooling's layers contracts are exhaustive themselves: import-linter breaks them on a module they leave out, and every
tandem_dev package of several modules must be the container of such a contract)."""

from __future__ import annotations

import re
import subprocess
import sys
import tomllib
from pathlib import Path

import grimp
import pytest

ROOT = Path(__file__).resolve().parents[1]
LAYERED = ("tandem_router", "tandem_operator", "tandem_dev")


def test_import_contracts_are_kept() -> None:
    lint_imports = Path(sys.executable).with_name("lint-imports")
    result = subprocess.run([str(lint_imports), "--no-cache"], cwd=ROOT, capture_output=True, text=True, timeout=120)
    assert result.returncode == 0, result.stdout + result.stderr
    assert "0 broken" in result.stdout


def layers_contracts() -> list[dict[str, object]]:
    config = tomllib.loads((ROOT / "pyproject.toml").read_text())
    return [c for c in config["tool"]["importlinter"]["contracts"] if c["type"] == "layers"]


def layered_names() -> set[str]:
    """Every module or package a layers contract names (a package covers what is under it), in full: a contract
    with containers names its layers relative to each container."""
    names: set[str] = set()
    for contract in layers_contracts():
        containers = contract.get("containers") or [""]
        assert isinstance(containers, list)
        assert isinstance(contract["layers"], list)
        for layer in contract["layers"]:
            for name in re.split(r"[|:]", layer):
                names.update(f"{c}.{name.strip()}" if c else name.strip() for c in containers)
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


def test_every_dev_tooling_package_is_layered_exhaustively() -> None:
    """tandem_dev and each of its packages of several modules is the container of an exhaustive layers contract,
    so import-linter itself breaks on a new module nobody placed."""
    graph = grimp.build_graph("tandem_dev")
    packages = {m for m in graph.modules if m == "tandem_dev" or m.startswith("tandem_dev.")}
    children = {p: [m for m in graph.modules if m.rpartition(".")[0] == p] for p in packages}
    several = {p for p, under in children.items() if len(under) > 1}
    exhaustive: set[str] = set()
    for contract in layers_contracts():
        containers = contract.get("containers") or []
        assert isinstance(containers, list)
        if contract.get("exhaustive"):
            exhaustive.update(containers)
    assert {"tandem_dev", "tandem_dev.chaos"} <= several  # the repository's package (not tests/tandem_dev)
    missing = sorted(several - exhaustive)
    assert missing == [], f"tandem_dev packages no exhaustive layers contract has as container: {missing}"
