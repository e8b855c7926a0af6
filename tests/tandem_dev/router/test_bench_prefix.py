"""``tandem bench prefix --quick`` runs end to end: three policies interleaved on a held-out multi-turn workload,
two seeds, each row with numbers. A smoke test, not a speed check; it asserts only what does not depend on timing:
every request served, the rounds' orders rotated, and the prefix-aware policies' cache hit rate (the simulators'
own, median over seeds) above round robin's."""

from __future__ import annotations

import pytest

from tandem_dev.router import bench_prefix
from tandem_dev.router.prefix_workload import HELD_OUT, SEED, TUNING
from tests.tandem_dev.benchhelpers import run_quick_bench


def _rows(out: str, title: str) -> list[list[str]]:
    table = out.split(f"## {title}")[1].split("##")[0]
    return [[c.strip() for c in r.split("|")] for r in table.splitlines() if "|" in r][1:]


@pytest.mark.netns
@pytest.mark.timeout(300)
def test_bench_prefix_quick_compares_three_policies() -> None:
    out = run_quick_bench("prefix", timeout=280)
    rows = {r[1]: r for r in _rows(out, "prefix-cache-aware routing")}
    assert len(rows) == 3, out
    hit = {name: float(r[5].split("%")[0]) for name, r in rows.items()}  # "73.3% (70.1%-76.5%)": the median
    for r in rows.values():
        assert r[0] == HELD_OUT[0].name, out
        assert r[2:5] == ["2", "72", "0"], out  # 2 seeds x 12 users x 3 turns, no errors
    smg = next(n for n in rows if n.startswith("smg"))
    assert hit["tandem cache_aware"] > hit["tandem round_robin"] + 10, out
    assert hit[smg] > hit["tandem round_robin"] + 10, out
    assert "## TTFT distribution per policy" in out
    per_run = _rows(out, "prefix bench: every run")
    assert len(per_run) == 6, out
    firsts = [r[3] for r in per_run if r[2] == "1"]
    assert len(set(firsts)) == 2, out  # each seed's round started with a different policy


def test_rounds_rotate_the_policies_and_hold_out_the_tuning_workload() -> None:
    plan = bench_prefix.rounds(quick=False)
    held_out = [r for r in plan if r.shape is not TUNING]
    assert all(r.seed != SEED for r in held_out)
    assert {r.shape for r in held_out} == set(HELD_OUT)
    for shape in HELD_OUT:
        mine = [r for r in held_out if r.shape is shape]
        assert len(mine) >= 3
        assert {r.rotation % 3 for r in mine} == {0, 1, 2}  # every policy first, middle and last once
    assert [r.label for r in plan if r.shape is TUNING] == [bench_prefix.REFERENCE]
