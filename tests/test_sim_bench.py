"""``tandem bench sim --quick`` runs end to end and prints both tables with numbers (a smoke test of the benchmark,
not a speed check: speed is compared side by side inside the benchmark's own table)."""

from __future__ import annotations

import re
import subprocess
import sys

import pytest


@pytest.mark.netns
@pytest.mark.timeout(180)
def test_bench_sim_quick_prints_tables() -> None:
    done = subprocess.run(
        [sys.executable, "-m", "tandem.cli", "bench", "sim", "--quick"],
        capture_output=True,
        text=True,
        timeout=170,
        check=False,
    )
    assert done.returncode == 0, done.stderr[-3000:]
    out = done.stdout
    assert "## sim: KV transfer over loopback" in out
    assert "## sim: simulated worker capacity" in out
    for row in ("mooncake tcp", "plain socket", "PD pair, prefill-heavy", "aggregated, decode-heavy"):
        line = next(line for line in out.splitlines() if row in line)
        numbers = [float(x.replace(",", "")) for x in re.findall(r"\| ([\d,.]+) ", line + " ")]
        assert numbers, line
        assert all(x > 0 for x in numbers), line
