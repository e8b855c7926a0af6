"""pytest-xdist work units for ``make test`` (``-n 2 --dist loadgroup``): a module's tests go to one worker
together (its module fixtures start once), and every ``k8s`` test goes to one worker (the dev cluster, a session
fixture, starts once), except the ``own_cluster`` ones: tests bound by timers (a 300 s scale-down window, 24 pod
recreations) rather than CPU, which go together to the other worker and its own dev cluster. Both k8s units are
handed out first, one to each worker; the module units then fill in behind them. With a single k8s unit the other
worker ran out of work ~15 min before the k8s one finished (CI of f6a57b3).

pytest-xdist 3.8's own ``xdist_group`` marker does not group under pytest 9.2: it renames ``item._nodeid``, which
pytest 9 no longer reads, so every test became a unit of its own. Here each worker writes every test's group to a
file in a folder the controller made (``pytest_configure_node`` hands its path over in ``workerinput``), and the
controller's scheduler (pytest-xdist's ``LoadScopeScheduling``, one scope a work unit, handed out in collection
order with ``--no-loadscope-reorder``) reads the groups from there: the workers have collected (and written)
before it schedules anything.
"""

from __future__ import annotations

import collections
import json
import os
import shutil
import tempfile
from pathlib import Path
from typing import Any

import pytest
from xdist.scheduler import LoadScopeScheduling

GROUPS_DIR = "tandem_groups_dir"
_groups_dir = pytest.StashKey[Path]()


def _module(nodeid: str) -> str:
    return nodeid.split("::", 1)[0]


K8S, K8S_OWN_CLUSTER = "k8s", "k8s-own-cluster"


def group_of(item: pytest.Item) -> str:
    if item.get_closest_marker("k8s") is None:
        return _module(item.nodeid)
    return K8S_OWN_CLUSTER if item.get_closest_marker("own_cluster") is not None else K8S


def pytest_configure(config: pytest.Config) -> None:
    controller = not hasattr(config, "workerinput")
    if controller and config.getvalue("dist") == "loadgroup" and config.getvalue("numprocesses"):
        config.stash[_groups_dir] = Path(tempfile.mkdtemp(prefix="tandem-xdist-groups-"))


def pytest_unconfigure(config: pytest.Config) -> None:
    folder = config.stash.get(_groups_dir, None)
    if folder is not None:
        shutil.rmtree(folder, ignore_errors=True)


@pytest.hookimpl(optionalhook=True)
def pytest_configure_node(node: Any) -> None:
    """Controller: tell each worker where to write its groups."""
    folder = node.config.stash.get(_groups_dir, None)
    if folder is not None:
        node.workerinput[GROUPS_DIR] = str(folder)


@pytest.hookimpl(trylast=True)
def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    """Worker: the k8s tests first (their units are the longest: handed out first, one to each worker), then every
    collected test's group, written once the order is final (atomically: the controller reads)."""
    folder = getattr(config, "workerinput", {}).get(GROUPS_DIR)
    if folder is None:
        return
    first = {K8S_OWN_CLUSTER: 0, K8S: 1}
    items.sort(key=lambda item: first.get(group_of(item), 2))  # stable: the order within a group stays
    path = Path(folder) / f"{config.workerinput['workerid']}.json"  # type: ignore[attr-defined]
    tmp = path.with_suffix(".tmp")
    tmp.write_text(json.dumps({item.nodeid: group_of(item) for item in items}))
    os.replace(tmp, path)


class GroupScheduling(LoadScopeScheduling):  # type: ignore[misc]  # pytest-xdist ships no types
    """``LoadScopeScheduling`` whose scope of a test is its group (``group_of``), as the workers wrote it."""

    def __init__(self, config: pytest.Config, folder: Path, log: Any = None) -> None:
        super().__init__(config, log)
        self.folder = folder
        self.groups: dict[str, str] | None = None

    def schedule(self) -> None:
        if self.collection is None:  # the first call: every worker has collected
            ids = next(iter(self.registered_collections.values()))
            repeated = sorted(nodeid for nodeid, n in collections.Counter(ids).items() if n > 1)
            if repeated:  # tests are handed out by node id: all but the first of each would silently not run
                raise pytest.UsageError(f"these node ids name more than one test (give each its own id): {repeated}")
        super().schedule()

    def _split_scope(self, nodeid: str) -> str:
        if self.groups is None:  # the workers' collections are identical (pytest-xdist checks): one file will do
            self.groups = json.loads(next(self.folder.glob("*.json")).read_text())
        return self.groups.get(nodeid) or _module(nodeid)


@pytest.hookimpl(optionalhook=True)
def pytest_xdist_make_scheduler(config: pytest.Config, log: Any) -> GroupScheduling | None:
    folder = config.stash.get(_groups_dir, None)
    return None if folder is None else GroupScheduling(config, folder, log)
