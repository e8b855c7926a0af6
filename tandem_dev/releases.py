"""Tandem's releases: each version, its git tag and the commit the tag names.

A release is tagged ``v<version>`` (``git tag -a v0.1.0 <commit> -m "Tandem 0.1.0"``) and listed here with its
commit, so a clone without tags (a shallow or tag-less fetch) still finds it by commit. tests/chart/
test_chart_upgrade_release_k8s.py installs the previous release (``PREVIOUS``) from its own tree and upgrades it
to this one; ``export`` writes such a tree (``git archive``) into a directory.
"""

from __future__ import annotations

import subprocess
from dataclasses import dataclass
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]


@dataclass(frozen=True)
class Release:
    """One released version: its tag and the full commit id the tag names."""

    version: str
    commit: str

    @property
    def tag(self) -> str:
        return f"v{self.version}"


RELEASES = (Release("0.1.0", "69d5aeb03940551fde9210b0a4b89e79c8703d43"),)
PREVIOUS = RELEASES[-1]  # the release this tree upgrades from


def resolve(release: Release, repo: Path = ROOT) -> str:
    """The commit to read ``release`` from: its tag's commit where the clone has the tag (which must name the
    listed commit), else the listed commit itself."""
    tagged = subprocess.run(
        ["git", "-C", str(repo), "rev-parse", "--verify", "--quiet", f"refs/tags/{release.tag}^{{commit}}"],
        capture_output=True,
        text=True,
        check=False,
    )
    if tagged.returncode == 0:
        found = tagged.stdout.strip()
        if found != release.commit:
            raise ValueError(f"tag {release.tag} names {found}, tandem_dev/releases.py lists {release.commit}")
        return found
    return release.commit


def export(release: Release, target: Path, repo: Path = ROOT) -> Path:
    """Write ``release``'s whole tree (``git archive``) into ``target``; returns ``target``."""
    archive = subprocess.run(
        ["git", "-C", str(repo), "archive", resolve(release, repo)], check=True, capture_output=True
    ).stdout
    target.mkdir(parents=True, exist_ok=True)
    subprocess.run(["tar", "-x", "-C", str(target)], input=archive, check=True)
    return target
