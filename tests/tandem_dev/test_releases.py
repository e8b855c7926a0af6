"""tandem_dev/releases.py: the release list, its tags, and this tree's version against it."""

from __future__ import annotations

import subprocess
import tomllib
from pathlib import Path

import pytest
import yaml

import tandem
from tandem_dev.releases import PREVIOUS, RELEASES, ROOT, Release, export, resolve


def _version(text: str) -> tuple[int, ...]:
    return tuple(int(part) for part in text.split("."))


def test_this_tree_has_one_version_newer_than_every_release() -> None:
    project = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]["version"]
    chart = yaml.safe_load((ROOT / "charts" / "tandem" / "Chart.yaml").read_text())
    assert project == chart["version"] == chart["appVersion"] == tandem.__version__
    assert all(_version(r.version) < _version(project) for r in RELEASES)
    assert max(RELEASES, key=lambda r: _version(r.version)) == PREVIOUS


def _git(repo: Path, *args: str) -> str:
    cmd = ["git", "-C", str(repo), "-c", "user.name=t", "-c", "user.email=t@example.com", *args]
    return subprocess.run(cmd, check=True, capture_output=True, text=True).stdout.strip()


def test_a_release_resolves_to_its_tag_else_its_listed_commit(tmp_path: Path) -> None:
    _git(tmp_path, "init", "-q")
    (tmp_path / "f").write_text("x")
    _git(tmp_path, "add", "f")
    _git(tmp_path, "commit", "-q", "-m", "one")
    commit = _git(tmp_path, "rev-parse", "HEAD")
    assert resolve(Release("9.9.9", commit), tmp_path) == commit  # no tag: the listed commit
    _git(tmp_path, "tag", "-a", "v9.9.9", "-m", "9.9.9")
    assert resolve(Release("9.9.9", commit), tmp_path) == commit
    with pytest.raises(ValueError, match=f"tag v9.9.9 names {commit}, tandem_dev/releases.py lists 0000"):
        resolve(Release("9.9.9", "0" * 40), tmp_path)


def test_the_previous_release_resolves_in_this_clone() -> None:
    assert resolve(PREVIOUS) == PREVIOUS.commit


def test_export_writes_the_release_tree(tmp_path: Path) -> None:
    tree = export(PREVIOUS, tmp_path / "release")
    chart = yaml.safe_load((tree / "charts" / "tandem" / "Chart.yaml").read_text())
    assert chart["appVersion"] == PREVIOUS.version
    assert f'__version__ = "{PREVIOUS.version}"' in (tree / "tandem" / "__init__.py").read_text()
