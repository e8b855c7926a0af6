"""``tandem bench autoscale``: the router-histogram p90 the decider reads, the HPA baseline on SGLang gauges, the
model's draws, and the section saved with its timeline PNG."""

from __future__ import annotations

import json
import math
from pathlib import Path

import numpy as np
import pytest
from prometheus_client import CollectorRegistry, Histogram, generate_latest

from tandem.registry import Role
from tandem_dev import autoscale_bench, autoscale_hpa, autoscale_model
from tandem_dev.autoscale_histogram import ITL_BOUNDS, TTFT_BOUNDS, cumulative, estimate_p90_ms, exact_p90_ms
from tandem_dev.bench import run as bench_run
from tandem_operator.autoscale.signals import parse_router
from tandem_router import metrics

pytestmark = pytest.mark.timeout(120)


def test_the_buckets_are_the_routers_and_bin_as_prometheus_client_does() -> None:
    values = [0.0005, 0.3, 1.0, 1.7, 2.5, 7.0, 400.0]  # bounds themselves included: ``le`` is inclusive
    registry = CollectorRegistry()
    h = Histogram("tandem_router_ttft_seconds", "", ["route"], buckets=metrics.LATENCY_BUCKETS, registry=registry)
    for v in values:
        h.labels("/v1/completions").observe(v)
    assert tuple(float(b) for b in metrics.LATENCY_BUCKETS) == TTFT_BOUNDS
    assert tuple(float(b) for b in metrics.ITL_BUCKETS) == ITL_BOUNDS
    assert cumulative([(v, 1.0) for v in values], TTFT_BOUNDS) == parse_router(generate_latest(registry).decode()).ttft


def test_a_known_distribution_is_recovered_within_its_bucket() -> None:
    rng = np.random.default_rng(0)
    seconds = rng.exponential(1.0, 20_000)  # p90 = ln 10 = 2.30 s, inside the (1, 2.5] bucket
    estimate = estimate_p90_ms([(float(v), 1.0) for v in seconds], TTFT_BOUNDS)
    assert 1000 < estimate <= 2500
    assert estimate == pytest.approx(1000 * math.log(10), abs=1500 * 0.1)  # 10 % of the bucket's width
    exact = exact_p90_ms([(float(v), 1.0) for v in seconds])
    assert exact == pytest.approx(1000 * math.log(10), rel=0.03)


def _bucket(value: float, bounds: tuple[float, ...]) -> tuple[float, float]:
    return max((b for b in bounds if b < value), default=0.0), min(b for b in bounds if b >= value)


def test_the_estimate_spreads_a_bucket_evenly_and_reads_zero_when_idle() -> None:
    # every TTFT 0.65 s, every gap 22 ms: each all in one bucket, read 90 % of the way through it
    for value, count, bounds in ((0.65, 40.0, TTFT_BOUNDS), (0.022, 4000.0, ITL_BOUNDS)):
        low, high = _bucket(value, bounds)
        assert estimate_p90_ms([(value, count)], bounds) == pytest.approx(1000 * (low + 0.9 * (high - low)))
    assert estimate_p90_ms([], ITL_BOUNDS) == 0.0
    assert exact_p90_ms([(0.025, 4000.0)]) == pytest.approx(25)
    assert exact_p90_ms([]) is None
    assert exact_p90_ms([(0.01, 9.0), (0.2, 1.0)]) == pytest.approx(10)  # rank 9 of 10: weighted nearest rank


@pytest.mark.parametrize(("bounds", "low", "high"), [(TTFT_BOUNDS, 0.25, 10.0), (ITL_BOUNDS, 0.01, 0.25)])
def test_the_routers_buckets_read_at_most_45_percent_high_where_targets_sit(
    bounds: tuple[float, ...], low: float, high: float
) -> None:
    """Where SLO targets and their scale-down thresholds sit, a single-bucket interval reads at most 45 % high (bounds
    at most 1.5x apart; the former (20, 50] ms gap bucket read a 21 ms interval as 47 ms, 2.2x: the decider never
    scaled decode down)."""
    for value in np.geomspace(low * 1.001, high, 200):
        assert estimate_p90_ms([(float(value), 100.0)], bounds) <= 1000 * value * 1.45


def test_the_sampled_model_is_seeded_and_matches_its_p90s() -> None:
    c = autoscale_model.conditions(2.0, 3, 1)
    a = autoscale_model.sample_second(np.random.default_rng(7), c, 20_000)
    b = autoscale_model.sample_second(np.random.default_rng(7), c, 20_000)
    assert a == b
    ttft_p90, _ = autoscale_model.model_p90_ms(c)
    assert exact_p90_ms([(v, 1.0) for v in a.ttft_s]) == pytest.approx(ttft_p90, rel=0.03)
    light, heavy = autoscale_model.model_p90_ms(c), autoscale_model.model_p90_ms(autoscale_model.conditions(3.0, 3, 1))
    assert heavy[0] > light[0]
    assert heavy[1] > light[1]
    saturated = autoscale_model.conditions(10.0, 1, 1)
    assert autoscale_model.model_p90_ms(saturated) == (autoscale_model.SATURATED_MS, autoscale_model.SATURATED_MS)
    flooded = autoscale_model.sample_second(np.random.default_rng(0), saturated, 3)
    assert flooded.prefill_waiting == autoscale_model.SATURATED_QUEUE
    assert flooded.decode_waiting == autoscale_model.SATURATED_QUEUE
    assert flooded.token_usage == pytest.approx(1.0, abs=0.01)


QUEUE = autoscale_hpa.Hpa("sglang:num_queue_reqs", 0.5, 1, 6)


def test_the_hpa_recommends_ceil_of_the_total_over_the_target_outside_its_tolerance() -> None:
    assert autoscale_hpa.recommend(QUEUE, 2, 1.05) == 2  # 1.05 / (0.5 x 2) = 1.05: within 10 %
    assert autoscale_hpa.recommend(QUEUE, 2, 3.0) == 6
    assert autoscale_hpa.recommend(QUEUE, 4, 0.0) == 0  # step() bounds it to minReplicas
    # status.replicas counts a group still starting (it reports nothing): the same total over more groups reads
    # lower, 1.2 / (0.5 x 3) = 0.8: scale down to ceil(1.2 / 0.5) = 3, i.e. hold
    assert autoscale_hpa.recommend(QUEUE, 3, 1.2) == 3


def test_the_hpa_scales_up_at_once_within_its_rate_and_down_only_after_its_window() -> None:
    desired, records = autoscale_hpa.step(QUEUE, (), 0, 1, 10.0)
    assert desired == 5  # ceil(10 / 0.5) = 20, at most max(1 + 4, 2 x 1) per period
    desired, records = autoscale_hpa.step(QUEUE, records, 15, 5, 10.0)
    assert desired == 6  # maxReplicas
    for t in range(30, 300, 15):
        desired, records = autoscale_hpa.step(QUEUE, records, t, 6, 0.0)
        assert desired == 6  # the 20 recorded at 0 s and 15 s hold the scale-down for 300 s
    desired, records = autoscale_hpa.step(QUEUE, records, 315, 6, 0.0)
    assert desired == 1


def test_policies_side_by_side() -> None:
    startup = next(s for s in autoscale_bench.startups() if s.peer_loading)  # K2.6 load phases, peer loading
    runs = {r.name: r for r in autoscale_bench.runs(startup)}
    auto, fixed, hpa = runs[autoscale_bench.AUTOSCALING], runs[autoscale_bench.FIXED], runs[autoscale_bench.HPA]
    assert [(r.met_requests, r.group_seconds) for r in autoscale_bench.runs(startup)] == [
        (r.met_requests, r.group_seconds) for r in runs.values()
    ]  # seeded: the same numbers every run
    assert auto.requests == fixed.requests == hpa.requests  # one arrival stream for every policy
    assert fixed.met_requests / fixed.requests > 0.95
    assert auto.group_seconds < fixed.group_seconds
    assert hpa.group_seconds < fixed.group_seconds
    # the decider alone reacts to a rise only once the p90s exceed the targets; a minimum raised a start-up ahead
    # of each rise keeps the SLO with fewer group-seconds than sizing for the peak
    scheduled = runs[autoscale_bench.SCHEDULED]
    assert scheduled.met_requests / scheduled.requests > 0.95 > auto.met_requests / auto.requests
    assert scheduled.group_seconds < fixed.group_seconds
    # the decider reads the histogram's estimate, not the exact p90, and the routers' buckets keep it on the right
    # side of the targets
    assert any(s.ttft_p90_ms != s.ttft_exact_ms for s in auto.samples if s.ttft_p90_ms is not None)
    assert auto.misjudged <= 0.02 * auto.intervals
    low = autoscale_bench.BOUNDS
    for r in runs.values():
        for s in r.samples:
            assert low[Role.PREFILL][0] <= s.prefill <= low[Role.PREFILL][1]
            assert low[Role.DECODE][0] <= s.decode <= low[Role.DECODE][1]


def test_the_start_time_models_and_the_schedules_lead() -> None:
    fixed, peer, node = autoscale_bench.startups()
    assert fixed.times[Role.DECODE].node_s == fixed.times[Role.DECODE].peer_s == autoscale_bench.STARTUP_S
    assert peer.times[Role.DECODE].peer_s < peer.times[Role.DECODE].node_s == node.times[Role.DECODE].node_s
    # the schedule leads by the slowest start-up plus one decision
    assert autoscale_bench.lead_s(peer, 15) == peer.times[Role.DECODE].node_s + 15


@pytest.mark.timeout(400)
def test_the_section_saves_its_tables_and_the_timeline_png(tmp_path: Path) -> None:
    out = tmp_path / "out"
    assert bench_run.main(["autoscale", "--quick", "--results-dir", str(out)]) == 0
    tables = json.loads((out / "results.json").read_text())["sections"]["autoscale"]["tables"]
    rows = [(s.name, p) for s in autoscale_bench.startups() for p in autoscale_bench.POLICIES]
    assert [(row[1], row[0]) for row in tables[0]["rows"]] == rows
    assert sorted((row[1], row[0]) for row in tables[1]["rows"]) == sorted(rows)
    assert (out / tables[2]["plot"]).read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
