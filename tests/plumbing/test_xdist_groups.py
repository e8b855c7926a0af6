"""``make test``'s two workers (``tests/plumbing/xdist_groups.py``): every test runs, a module's tests on one worker,
every ``k8s`` test on one worker and the ``own_cluster`` ones on the other; node ids that name two tests stop the run
instead of silently running one of them."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

pytestmark = pytest.mark.procs  # starts two pytest-xdist worker processes

REPO = Path(__file__).resolve().parents[2]
INNER = ("-p", "tests.plumbing.xdist_groups", "-p", "no:cacheprovider", "-n", "2", "--dist", "loadgroup",
         "--no-loadscope-reorder", "-o", "markers=k8s: x\nown_cluster: y")  # fmt: skip

RECORDER = """
import json, os, pytest

@pytest.fixture(autouse=True)
def record(request):
    with open(os.environ["RUNS"], "a") as f:
        f.write(json.dumps([request.node.nodeid, os.environ["PYTEST_XDIST_WORKER"]]) + "\\n")
"""


def _module(k8s: bool, n: int, own_cluster: bool = False) -> str:
    mark = ("@pytest.mark.k8s\n" if k8s else "") + ("@pytest.mark.own_cluster\n" if own_cluster else "")
    return "import pytest\n" + "".join(f"{mark}def test_{i}(): pass\n" for i in range(n))


def test_every_test_runs_a_module_on_one_worker_and_every_k8s_test_on_one(
    pytester: pytest.Pytester, monkeypatch: pytest.MonkeyPatch, tmp_path: Path
) -> None:
    monkeypatch.setenv("PYTHONPATH", str(REPO))
    monkeypatch.setenv("RUNS", str(tmp_path / "runs.jsonl"))
    pytester.makeconftest(RECORDER)
    pytester.makepyfile(
        test_a=_module(False, 5), test_b=_module(False, 5), test_c=_module(False, 5),
        test_k1=_module(True, 3), test_k2=_module(True, 3),
    )  # fmt: skip
    result = pytester.runpytest_subprocess(*INNER)
    assert result.ret == 0, result.stdout.str()
    runs = [json.loads(line) for line in (tmp_path / "runs.jsonl").read_text().splitlines()]
    assert len(runs) == 21  # every test, once
    assert len({nodeid for nodeid, _ in runs}) == 21
    workers: dict[str, set[str]] = {}
    for nodeid, worker in runs:
        module = nodeid.split("::")[0]
        workers.setdefault("k8s" if module.startswith("test_k") else module, set()).add(worker)
    assert all(len(w) == 1 for w in workers.values()), workers


def test_node_ids_that_name_two_tests_stop_the_run(pytester: pytest.Pytester, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("PYTHONPATH", str(REPO))
    pytester.makeconftest("def pytest_collection_modifyitems(items):\n    items.append(items[0])\n")
    pytester.makepyfile(test_a=_module(False, 2))
    result = pytester.runpytest_subprocess(*INNER)
    assert result.ret == pytest.ExitCode.USAGE_ERROR
    result.stderr.fnmatch_lines(["*node ids name more than one test*test_a.py::test_0*"])


def test_own_cluster_k8s_tests_run_together_on_the_other_worker_than_the_k8s_ones(
    pytester: pytest.Pytester, monkeypatch: pytest.MonkeyPatch, tmp_path: Path
) -> None:
    monkeypatch.setenv("PYTHONPATH", str(REPO))
    monkeypatch.setenv("RUNS", str(tmp_path / "runs.jsonl"))
    pytester.makeconftest(RECORDER)
    pytester.makepyfile(  # the k8s modules sort last: both k8s units must still be handed out first
        test_a=_module(False, 4), test_b=_module(False, 4),
        test_k1=_module(True, 3), test_k2=_module(True, 2, own_cluster=True), test_k3=_module(True, 2),
        test_k4=_module(True, 1, own_cluster=True),
    )  # fmt: skip
    result = pytester.runpytest_subprocess(*INNER)
    assert result.ret == 0, result.stdout.str()
    runs = [json.loads(line) for line in (tmp_path / "runs.jsonl").read_text().splitlines()]
    assert len({nodeid for nodeid, _ in runs}) == len(runs) == 16
    k8s = {worker for nodeid, worker in runs if nodeid.startswith(("test_k1", "test_k3"))}
    own = {worker for nodeid, worker in runs if nodeid.startswith(("test_k2", "test_k4"))}
    assert len(k8s) == len(own) == 1, runs
    assert k8s != own, runs
    first = {worker: nodeid for nodeid, worker in reversed(runs)}  # each worker's first test
    assert sorted(first.values()) == ["test_k1.py::test_0", "test_k2.py::test_0"], runs
