"""``tandem bench operator --quick`` runs end to end on its own 40-node control plane and prints a table with
numbers (a smoke test of the benchmark, not a speed check)."""

from __future__ import annotations

import re

import pytest

from tests.tandem_dev.benchhelpers import run_quick_bench

ROWS = (
    "pods created by the operator",
    "pods scheduled and Ready",
    "every group Ready",
    "every group registered",
    "peak RSS",
    "Kubernetes API requests",
    "(fence, etcd watch)",
    "operator's own timing",
    "group re-registered, epoch 0 -> 1",
    "PDCluster Ready again",
)


@pytest.mark.k8s
@pytest.mark.timeout(300)
def test_bench_operator_quick_prints_a_table_with_numbers() -> None:
    out = run_quick_bench("operator", timeout=290)
    assert "## operator: one PDCluster, 10 groups x 4 nodes on 40 kwok GPU nodes" in out
    for row in ROWS:
        line = next(line for line in out.splitlines() if row in line)
        (value,) = re.findall(r"\| ([\d,.]+|nan) +\|", line)
        number = float(value.replace(",", ""))
        assert number > 0, line  # False for nan too
