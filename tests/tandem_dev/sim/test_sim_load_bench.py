"""``tandem bench sim-load --quick`` runs end to end: one saturation table (and PNG) per profile, with numbers and a
knee; the kimi table carries the comparison with the published numbers. A smoke test, not a speed check."""

from __future__ import annotations

import re

import pytest

from tests.tandem_dev.benchhelpers import run_quick_bench


@pytest.mark.netns
@pytest.mark.timeout(150)
def test_bench_sim_load_quick_prints_a_table_per_profile() -> None:
    out = run_quick_bench("sim-load", timeout=140)
    for profile in ("instant", "cpu-small", "kimi-k2.6-h200"):
        table = out.split(f"## sim-load: saturation, --sim-profile {profile}")[1].split("##")[0]
        rows = [line for line in table.splitlines() if re.match(r"^ \d+ +\|", line)]
        assert [int(r.split("|")[0]) for r in rows] == [1, 4, 16], table
        assert "<- knee" in table
        for row in rows:
            rate = float(row.split("|")[1].replace(",", ""))
            assert rate > 0, row
    assert "tok/s vs published" in out
