"""Save the figures a test or script measured as JSON, with the context ``tandem bench`` saves with its tables too
(``context``: git commit, machine, peers' versions, arguments), so that every README table has a results file behind
it, not only those ``tandem bench`` and ``tandem chaos`` write.

Layout: ``build/records/<name>.json`` (``build/`` is not tracked); a test's name is its node id
(tests/conftest.py, the ``record`` fixture), a script's its module.
"""

from __future__ import annotations

import os
import platform
import re
import subprocess
import time
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any

import orjson

from tandem_dev import peers

RECORDS = Path("build") / "records"


def _git(*args: str) -> str:
    try:
        done = subprocess.run(["git", *args], capture_output=True, text=True, check=False, timeout=10)
    except OSError:
        return ""
    return done.stdout.strip() if done.returncode == 0 else ""


def context(argv: Sequence[str]) -> dict[str, Any]:
    """What a reader needs to compare two runs: code, machine, peers, arguments."""
    return {
        "started_utc": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime()),
        "argv": list(argv),
        "git": {"commit": _git("rev-parse", "HEAD") or "unknown", "dirty": bool(_git("status", "--porcelain"))},
        "machine": {
            "cores": os.cpu_count(),
            "load_average_at_start": list(os.getloadavg()),
            "platform": platform.platform(),
            "python": platform.python_version(),
        },
        "peers": peers.versions(),
    }


def path_for(name: str, folder: Path = RECORDS) -> Path:
    """``folder/<name>.json``, with every character but letters, digits, ``.``, ``_`` and ``-`` made ``_``."""
    return folder / f"{re.sub(r'[^A-Za-z0-9._-]+', '_', name).strip('_')}.json"


def save(name: str, figures: Mapping[str, object], argv: Sequence[str], folder: Path = RECORDS) -> Path:
    """Write ``figures`` (anything orjson takes; other values as ``str``) with the run's context; returns the path."""
    path = path_for(name, folder)
    path.parent.mkdir(parents=True, exist_ok=True)
    doc = {"name": name, **context(argv), "figures": dict(figures)}
    path.write_bytes(orjson.dumps(doc, option=orjson.OPT_INDENT_2 | orjson.OPT_NON_STR_KEYS, default=str))
    return path


class Recorder:
    """Saves one run's figures under one name; each call adds to them and rewrites the file (tests/conftest.py's
    ``record`` fixture hands one to a test, named by its node id)."""

    def __init__(self, name: str, argv: Sequence[str], folder: Path = RECORDS) -> None:
        self.name, self.argv, self.folder = name, list(argv), folder
        self.figures: dict[str, object] = {}

    def __call__(self, figures: Mapping[str, object]) -> Path:
        self.figures.update(figures)
        return save(self.name, self.figures, self.argv, self.folder)
