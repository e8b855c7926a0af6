"""``-m`` leaves a module out before importing it only when pytest itself would deselect every test in it."""

from __future__ import annotations

from pathlib import Path

import pytest

from tests.plumbing.markfilter import UNUSED_IN_UNIT_PLUGINS, deselected_whole

UNIT = "not (netns or k8s or slow or procs)"


def module(tmp_path: Path, source: str) -> Path:
    path = tmp_path / "test_x.py"
    path.write_text("import pytest\n\n" + source)
    return path


@pytest.mark.parametrize(
    ("source", "markexpr", "left_out"),
    [
        ("pytestmark = pytest.mark.netns\ndef test_a(): pass\n", UNIT, True),
        ("pytestmark = [pytest.mark.k8s, pytest.mark.timeout(300)]\ndef test_a(): pass\n", UNIT, True),
        ("pytestmark = pytest.mark.procs\nclass TestA:\n    def test_a(self): pass\n", UNIT, True),
        ("@pytest.mark.slow\ndef test_a(): pass\n@pytest.mark.procs\nasync def test_b(): pass\n", UNIT, True),
        # a test the expression may select stays
        ("def test_a(): pass\n", UNIT, False),
        ("@pytest.mark.slow\ndef test_a(): pass\ndef test_b(): pass\n", UNIT, False),
        ("pytestmark = pytest.mark.netns\ndef test_a(): pass\n", "netns", False),
        # marks a test may get at run time (a conftest hook): a positive expression never leaves a module out
        ("def test_a(): pass\n", "procs", False),
        # marks not known from the source: imported as before
        ("@some_decorator\n@pytest.mark.slow\ndef test_a(): pass\n", UNIT, False),
        ("class TestA:\n    @pytest.mark.slow\n    def test_a(self): pass\n", UNIT, False),
        (
            "@pytest.mark.parametrize('x', [pytest.param(1, marks=pytest.mark.netns)])\n"
            "@pytest.mark.slow\ndef test_a(x): pass\n",
            "not netns",
            False,
        ),
        ("pytestmark = pytest.mark.timeout(30)\ndef test_a(): pass\n", "not timeout(30)", False),
        ("pytestmark = MARKS\ndef test_a(): pass\n", UNIT, False),
        ("def helper(): pass\n", UNIT, False),
    ],
)
def test_a_module_is_left_out_only_when_every_test_is_deselected(
    source: str, markexpr: str, left_out: bool, tmp_path: Path
) -> None:
    assert deselected_whole(module(tmp_path, source), markexpr) is left_out


def test_pytest_selects_the_same_tests_with_and_without_the_filter(pytester: pytest.Pytester) -> None:
    pytester.makeconftest("from tests.conftest import pytest_ignore_collect  # noqa: F401\n")
    pytester.makeini("[pytest]\nasyncio_default_fixture_loop_scope = function\nmarkers =\n  netns: x\n  procs: x\n")
    pytester.makepyfile(
        test_netns="import pytest\npytestmark = pytest.mark.netns\ndef test_a(): pass\n",
        test_mixed="import pytest\n@pytest.mark.procs\ndef test_b(): pass\ndef test_c(): pass\n",
        test_plain="def test_d(): pass\n",
    )
    result = pytester.runpytest("-m", "not (netns or procs)", "-p", "no:cacheprovider", *UNUSED_IN_UNIT_PLUGINS)
    result.assert_outcomes(passed=2, deselected=1)  # test_netns.py is not even collected
    result = pytester.runpytest("-m", "netns or procs", "-p", "no:cacheprovider", *UNUSED_IN_UNIT_PLUGINS)
    result.assert_outcomes(passed=2, deselected=2)
