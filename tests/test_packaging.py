"""The runtime wheel (what the image installs) holds runtime code only: no ``tandem_dev``; the development venv
still imports it, and the runtime CLI names the missing package instead of a traceback."""

from __future__ import annotations

import importlib.abc
import importlib.machinery
import shutil
import subprocess
import sys
import zipfile
from pathlib import Path

import pytest
from setuptools.config.pyprojecttoml import read_configuration  # type: ignore[import-untyped]

from tandem import cli

ROOT = Path(__file__).resolve().parents[1]
RUNTIME_PACKAGES = {"tandem", "tandem_sim", "tandem_router", "tandem_operator"}
# What the wheel needs to build, as the Dockerfile's wheels stage copies it, plus tandem_dev, so the exclusion is
# what keeps it out (not its absence from the build directory).
BUILD_INPUTS: tuple[str, ...] = ("pyproject.toml", "README.md", "constraints.txt", "tandem", "simulator", "router")
BUILD_INPUTS += ("operator", "tandem_dev")


class WithoutTandemDev(importlib.abc.MetaPathFinder):
    """Imports of tandem_dev fail as where it is not installed (the runtime image)."""

    def find_spec(self, fullname: str, path: object, target: object = None) -> importlib.machinery.ModuleSpec | None:
        if fullname == "tandem_dev":
            raise ModuleNotFoundError(f"No module named {fullname!r}", name=fullname)
        return None


def dev_packages() -> set[str]:
    return {".".join(p.relative_to(ROOT).parent.parts) for p in (ROOT / "tandem_dev").rglob("__init__.py")}


def test_package_discovery_finds_every_runtime_package_and_no_dev_package() -> None:
    packages = set(read_configuration(ROOT / "pyproject.toml")["tool"]["setuptools"]["packages"])
    assert packages >= RUNTIME_PACKAGES
    assert "tandem_router.policy" in packages  # subpackages too
    assert {"tandem_dev", "tandem_dev.devcluster", "tandem_dev.router"} <= dev_packages()
    assert not {p for p in packages if p.split(".")[0] == "tandem_dev"}


def test_the_dev_venv_imports_tandem_dev_from_the_checkout() -> None:
    import tandem_dev.bench

    assert Path(tandem_dev.bench.__file__).resolve() == ROOT / "tandem_dev" / "bench" / "__init__.py"


@pytest.mark.parametrize("command", ["bench", "up", "chaos", "dev-cluster"])
def test_dev_commands_without_tandem_dev_name_the_missing_package(
    command: str, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    for name in [m for m in sys.modules if m.split(".")[0] == "tandem_dev"]:
        monkeypatch.delitem(sys.modules, name)
    monkeypatch.setattr(sys, "meta_path", [WithoutTandemDev(), *sys.meta_path])
    assert cli.main([command, "--help"]) == 2
    err = capsys.readouterr().err
    assert f"tandem {command}: needs the development package 'tandem_dev'" in err
    assert "Traceback" not in err


@pytest.mark.procs
@pytest.mark.timeout(120)
def test_the_built_wheel_ships_runtime_code_only(tmp_path: Path) -> None:
    src = tmp_path / "src"
    src.mkdir()
    for name in BUILD_INPUTS:
        path = ROOT / name
        if path.is_dir():
            shutil.copytree(path, src / name, ignore=shutil.ignore_patterns("__pycache__", "*.egg-info"))
        else:
            shutil.copy2(path, src / name)
    subprocess.run(
        [sys.executable, "-m", "pip", "wheel", "-q", "--no-deps", "--no-build-isolation", "-w", str(tmp_path), "."],
        cwd=src,
        check=True,
        timeout=110,
    )
    (wheel,) = tmp_path.glob("tandem-*.whl")
    top = {name.split("/")[0] for name in zipfile.ZipFile(wheel).namelist()}
    assert {*RUNTIME_PACKAGES, "tandem_router"} <= top
    assert "tandem_dev" not in top
    names = zipfile.ZipFile(wheel).namelist()
    assert "tandem_router/main.py" in names
    assert "tandem_operator/run/main.py" in names
    assert not [n for n in names if n.endswith(".txt") and "/peers/" in n]  # the peers' pins moved with them
