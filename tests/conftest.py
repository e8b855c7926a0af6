"""Suite-wide fixtures. Warnings are errors and every test has a timeout (pyproject.toml).

Tests marked ``netns`` start Mooncake processes (which listen on every interface) or change per-namespace
sysctls: the session refuses to run them outside a loopback-only network namespace instead of running them on
the host.
"""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path

import pytest

from tandem.procs import ManagedProcess
from tests.netns import HOW, interfaces, loopback_only


@pytest.fixture
def proc_factory(tmp_path: Path) -> Iterator[list[ManagedProcess]]:
    """A list to append started ManagedProcess objects to; every one is stopped (by process group) at teardown.

    Each process logs to ``tmp_path/<name>.log``; the tail of every log is printed when the test fails.
    """
    procs: list[ManagedProcess] = []
    yield procs
    for proc in reversed(procs):
        proc.stop()


def pytest_collection_finish(session: pytest.Session) -> None:
    """Stop before running anything if a selected ``netns`` test would run in the host's network namespace."""
    netns = [item.nodeid for item in session.items if item.get_closest_marker("netns") is not None]
    if netns and not loopback_only():
        listed = "\n  ".join(netns[:5]) + ("\n  ..." if len(netns) > 5 else "")
        pytest.exit(
            f"{len(netns)} selected test(s) are marked netns but this network namespace has "
            f"{', '.join(interfaces())}, not only lo: {HOW}.\n  {listed}",
            returncode=pytest.ExitCode.USAGE_ERROR,
        )


pytest_plugins = ["tests.devcluster_fixtures", "pytester", "tests.ci_skips"]
