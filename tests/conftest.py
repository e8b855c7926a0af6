"""Suite-wide fixtures. Warnings are errors and every test has a timeout (pyproject.toml).

Tests marked ``netns`` start Mooncake processes (which listen on every interface) or change per-namespace
sysctls: the session refuses to run them outside a loopback-only network namespace instead of running them on
the host.
"""

from __future__ import annotations

from collections.abc import Generator, Iterator
from pathlib import Path

import pytest

from tandem_dev import records
from tandem_dev.procs import ManagedProcess
from tests.plumbing.markfilter import deselected_whole
from tests.plumbing.netns import HOW, enter_own, interfaces, loopback_only


@pytest.fixture
def proc_factory(tmp_path: Path) -> Iterator[list[ManagedProcess]]:
    """A list to append started ManagedProcess objects to; every one is stopped (by process group) at teardown.

    Each process logs to ``tmp_path/<name>.log``; the tail of every log is printed when the test fails.
    """
    procs: list[ManagedProcess] = []
    yield procs
    for proc in reversed(procs):
        proc.stop()


@pytest.fixture
def record(request: pytest.FixtureRequest) -> records.Recorder:
    """``record({...})`` saves the figures a test measures (those it prints with ``-s``, which README tables copy)
    to ``build/records/<node id>.json`` under the repository, with the run's context (tandem_dev.records)."""
    config = request.config
    argv = ["pytest", *config.invocation_params.args]
    return records.Recorder(request.node.nodeid, argv, config.rootpath / records.RECORDS)


def pytest_configure(config: pytest.Config) -> None:
    """A worker of a session inside a loopback-only network namespace (``scripts/in-netns.sh``) gets a namespace of
    its own (``netns.enter_own``): the two workers' servers then never share an address or port."""
    if hasattr(config, "workerinput") and loopback_only():  # pytester's inner sessions have no workerinput
        enter_own()


def pytest_ignore_collect(collection_path: Path, config: pytest.Config) -> bool | None:
    """With ``-m`` (``make unit``), a test module whose every test the expression deselects is not imported."""
    markexpr = config.getoption("markexpr")
    if markexpr and collection_path.suffix == ".py" and collection_path.name.startswith("test_"):
        return deselected_whole(collection_path, markexpr) or None
    return None


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


@pytest.hookimpl(wrapper=True, tryfirst=True)
def pytest_terminal_summary(terminalreporter: pytest.TerminalReporter) -> Generator[None]:
    """The failing tests' ids, one short line each, after the short summary and just before pytest's totals: CI
    keeps only the tail of the output, and under ``CI`` pytest prints each failure's whole message there."""
    yield
    failed = [r.nodeid for kind in ("failed", "error") for r in terminalreporter.stats.get(kind, ())]
    if failed:
        terminalreporter.write_sep("=", f"{len(failed)} failing test(s)")
        for nodeid in dict.fromkeys(failed):
            terminalreporter.write_line(f"FAILING {nodeid}")


pytest_plugins = [
    "tests.tandem_dev.devcluster.devcluster_fixtures",
    "pytester",
    "tests.plumbing.ci_skips",
    "tests.plumbing.xdist_groups",
]
