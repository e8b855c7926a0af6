"""``tandem bench autoscale``: the model's three policies on one trace, saved with the timeline PNG."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from tandem.registry import Role
from tandem_dev import autoscale_bench, bench

pytestmark = pytest.mark.timeout(60)


def test_the_latency_model_grows_with_load_and_saturates() -> None:
    light, heavy = autoscale_bench.latency(1.0, 2, 1), autoscale_bench.latency(2.0, 2, 1)
    assert heavy.ttft_ms > light.ttft_ms
    assert heavy.itl_ms > light.itl_ms
    assert autoscale_bench.latency(10.0, 1, 1).ttft_ms == autoscale_bench.SATURATED_MS


def test_policies_side_by_side() -> None:
    runs = {r.name: r for r in autoscale_bench.runs()}
    auto, fixed, hpa = runs["autoscaling (tandem)"], runs["fixed for the peak"], runs["HPA on CPU (modelled)"]
    assert fixed.met_requests == fixed.requests  # sized for the peak: every request meets the SLO
    assert auto.group_seconds < fixed.group_seconds
    assert auto.met_requests / auto.requests > 0.9
    assert hpa.met_requests / hpa.requests < auto.met_requests / auto.requests  # CPU does not see the GPUs
    low = autoscale_bench.BOUNDS
    for r in runs.values():
        for s in r.samples:
            assert low[Role.PREFILL][0] <= s.prefill <= low[Role.PREFILL][1]
            assert low[Role.DECODE][0] <= s.decode <= low[Role.DECODE][1]


def test_the_section_saves_its_tables_and_the_timeline_png(tmp_path: Path) -> None:
    out = tmp_path / "out"
    assert bench.main(["autoscale", "--results-dir", str(out)]) == 0
    tables = json.loads((out / "results.json").read_text())["sections"]["autoscale"]["tables"]
    assert [row[0] for row in tables[0]["rows"]] == [
        "autoscaling (tandem)",
        "fixed for the peak",
        "HPA on CPU (modelled)",
    ]
    assert (out / tables[1]["plot"]).read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
