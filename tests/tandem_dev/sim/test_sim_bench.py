"""``tandem bench sim --quick`` runs end to end and prints both tables with numbers (a smoke test of the benchmark,
not a speed check: speed is compared side by side inside the benchmark's own table)."""

from __future__ import annotations

import re

import pytest

from tests.tandem_dev.benchhelpers import run_quick_bench


@pytest.mark.netns
@pytest.mark.timeout(180)
def test_bench_sim_quick_prints_tables() -> None:
    out = run_quick_bench("sim", timeout=170)
    assert "## sim: KV transfer over loopback" in out
    assert "## sim: simulated worker capacity" in out
    assert "## sim: KV transfer, 8 ranks per pod vs 1 rank" in out
    for row in ("mooncake tcp", "plain socket", "PD pair, prefill-heavy", "aggregated, decode-heavy", "| 8 "):
        line = next(line for line in out.splitlines() if row in line)
        numbers = [float(x.replace(",", "")) for x in re.findall(r"\| ([\d,.]+) ", line + " ")]
        assert numbers, line
        assert all(x > 0 for x in numbers), line
