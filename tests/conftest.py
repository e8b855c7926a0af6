"""Suite-wide fixtures. Warnings are errors and every test has a timeout (pyproject.toml)."""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path

import pytest

from tandem.procs import ManagedProcess


@pytest.fixture
def proc_factory(tmp_path: Path) -> Iterator[list[ManagedProcess]]:
    """A list to append started ManagedProcess objects to; every one is stopped (by process group) at teardown.

    Each process logs to ``tmp_path/<name>.log``; the tail of every log is printed when the test fails.
    """
    procs: list[ManagedProcess] = []
    yield procs
    for proc in reversed(procs):
        proc.stop()


pytest_plugins = ["tests.devcluster_fixtures", "tests.ci_skips"]
