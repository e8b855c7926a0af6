"""``tandem bench prefix --quick`` runs end to end: three policies on the same multi-turn workload, each row with
numbers. A smoke test, not a speed check; it asserts only what does not depend on timing: every request served
and the prefix-aware policies' cache hit rate (the simulators' own) above round robin's."""

from __future__ import annotations

import pytest

from tests.tandem_dev.benchhelpers import run_quick_bench


@pytest.mark.netns
@pytest.mark.timeout(300)
def test_bench_prefix_quick_compares_three_policies() -> None:
    out = run_quick_bench("prefix", timeout=280)
    table = out.split("## prefix-cache-aware routing")[1].split("##")[0]
    rows = {r.split("|")[0].strip(): [c.strip() for c in r.split("|")] for r in table.splitlines() if "|" in r}
    names = [n for n in rows if n != "policy"]
    assert len(names) == 3, table
    hit = {name: float(rows[name][3].rstrip("%")) for name in names}
    for name in names:
        assert rows[name][1] == "36", table  # 12 users x 3 turns
        assert rows[name][2] == "0", table
    smg = next(n for n in names if n.startswith("smg"))
    assert hit["tandem cache_aware"] > hit["tandem round_robin"] + 10, table
    assert hit[smg] > hit["tandem round_robin"] + 10, table
    assert "## TTFT distribution per policy" in out
