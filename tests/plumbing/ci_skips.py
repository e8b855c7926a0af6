"""Under ``make test`` (which sets ``TANDEM_FAIL_UNEXPECTED_SKIPS=1``) and under ``CI=true`` an unexpected skip fails
the run: a skip is allowed only when its reason starts with ``UNRUNNABLE`` and says why the test cannot run anywhere
here (today only tc netem latency, which this kernel lacks).

Everything a test needs is installed by ``make test`` (Debian packages, .venv, the peers, the control plane), so
a skip there means a missing install step or a guard that hides a failure. A plain ``pytest`` run (a developer
running a few tests without the peers installed) keeps skips as skips.
"""

from __future__ import annotations

import os
from collections.abc import Generator

import pytest

UNRUNNABLE = "cannot run anywhere here:"


def _reason(report: pytest.TestReport | pytest.CollectReport) -> str:
    longrepr = report.longrepr
    return str(longrepr[2]) if isinstance(longrepr, tuple) else str(longrepr)


STRICT_ENV = "TANDEM_FAIL_UNEXPECTED_SKIPS"


def _strict() -> bool:
    return os.environ.get("CI") == "true" or os.environ.get(STRICT_ENV) == "1"


def _fail_unexpected_skip(report: pytest.TestReport | pytest.CollectReport) -> None:
    if not report.skipped or hasattr(report, "wasxfail") or not _strict():
        return
    reason = _reason(report)
    if not reason.removeprefix("Skipped: ").startswith(UNRUNNABLE):
        report.outcome = "failed"
        report.longrepr = f"unexpected skip under make test / CI=true (only '{UNRUNNABLE} <why>' may skip): {reason}"


@pytest.hookimpl(wrapper=True)
def pytest_runtest_makereport(
    item: pytest.Item, call: pytest.CallInfo[None]
) -> Generator[None, pytest.TestReport, pytest.TestReport]:
    report = yield
    _fail_unexpected_skip(report)
    return report


@pytest.hookimpl(wrapper=True)
def pytest_make_collect_report(
    collector: pytest.Collector,
) -> Generator[None, pytest.CollectReport, pytest.CollectReport]:
    report = yield
    _fail_unexpected_skip(report)
    return report
