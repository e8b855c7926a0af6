"""``tandem bench sim-startup --quick`` runs end to end: one row per weight source of a recreated K2.6 decode, with
the peer's modelled time inside issue #35's 90 s (the goal is a modelled one). A smoke test: quick mode scales time by
0.02, so a second of process start-up under load reads as 50 s in the measured column, which is checked only for
being measured (the full run's measured column is the figure; under load 10 quick runs measured the peer at 130 s).
Then decode scaled 1 -> 4: which source each new group gets from the operator's seed choice."""

from __future__ import annotations

import pytest

from tests.tandem_dev.benchhelpers import run_quick_bench


@pytest.mark.netns
@pytest.mark.timeout(200)
def test_bench_sim_startup_quick_prints_a_row_per_source() -> None:
    out = run_quick_bench("sim-startup", timeout=190)
    table = out.split("## sim-startup: recreated K2.6 decode -> serving, per weight source")[1]
    for source in ("hub download", "node copy (NVMe)", "peer (Mooncake)"):
        assert source in table, table
    peer = [cell.strip() for cell in next(line for line in table.splitlines() if line.startswith(" peer")).split("|")]
    modelled, measured = float(peer[2]), float(peer[3])
    assert modelled <= 90, table
    assert measured > 0, table
    # decode 1 -> 4 with the operator's seed choice: two groups from decode-0 (maxLoadsPerSeed 2), one from the node
    scale = out.split("## sim-startup: decode scaled 1 -> 4")[1]
    on = [[c.strip() for c in line.split("|")] for line in scale.splitlines() if line.startswith(" on ")]
    assert [row[2] for row in on] == ["peer (Mooncake) from decode-0"] * 2 + ["node copy (NVMe)", ""], scale
    assert float(on[-1][3]) == max(float(row[3]) for row in on[:-1]), scale
