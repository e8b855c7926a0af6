"""The make test / CI=true rule: an unexpected skip fails the run, an explained "cannot run anywhere here" skip does
not; a plain pytest run keeps skips."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

from tests.plumbing.ci_skips import STRICT_ENV

ROOT = Path(__file__).resolve().parents[2]

CASES = """
import pytest

from tests.plumbing.ci_skips import UNRUNNABLE


def test_plain_skip():
    pytest.skip("helm is not built")


@pytest.mark.skipif(True, reason="no wheel")
def test_skipif():
    pass


def test_explained_skip():
    pytest.skip(f"{UNRUNNABLE} needs an InfiniBand NIC, which no machine of this project has")


@pytest.mark.xfail(reason="known", strict=True)
def test_xfail():
    assert False


def test_pass():
    pass
"""


def _run(tmp_path: Path, strict: dict[str, str]) -> subprocess.CompletedProcess[str]:
    (tmp_path / "test_cases.py").write_text(CASES)
    env = {k: v for k, v in os.environ.items() if k not in ("CI", STRICT_ENV)}  # make test sets STRICT_ENV itself
    env |= {**strict, "PYTHONPATH": str(ROOT)}
    argv = [sys.executable, "-m", "pytest", "-p", "tests.plumbing.ci_skips", "-p", "no:cacheprovider", "-q", "-rA"]
    return subprocess.run(
        [*argv, "-c", os.devnull, "--rootdir", str(tmp_path), str(tmp_path / "test_cases.py")],
        capture_output=True, text=True, env=env, cwd=tmp_path, timeout=60, check=False,
    )  # fmt: skip


@pytest.mark.procs
@pytest.mark.parametrize(
    "strict", [{"CI": "true"}, {STRICT_ENV: "1"}, {"CI": ""}, {}], ids=["ci", "make-test", "ci-empty", "plain"]
)
def test_unexpected_skips_fail_under_make_test_and_ci(tmp_path: Path, strict: dict[str, str]) -> None:
    done = _run(tmp_path, strict)
    out = done.stdout
    if strict in ({"CI": "true"}, {STRICT_ENV: "1"}):
        assert done.returncode == 1, out
        assert "FAILED test_cases.py::test_plain_skip" in out, out
        assert "ERROR test_cases.py::test_skipif" in out, out  # a skipif mark skips in setup: an error there
        assert "unexpected skip under make test / CI=true" in out, out
        assert "1 failed, 1 passed, 1 skipped, 1 xfailed, 1 error" in out, out
    else:
        assert done.returncode == 0, out
        assert "1 passed, 3 skipped, 1 xfailed" in out, out
