"""Parsing the routers' and workers' expositions, and the interval p90 (checked against prometheus_client's own
histogram output)."""

from __future__ import annotations

from pathlib import Path

import pytest
from prometheus_client import CollectorRegistry, Gauge, Histogram, generate_latest

from tandem_operator.autoscale.signals import (
    FLOW_QUEUED,
    combine,
    interval_buckets,
    parse_router,
    parse_worker,
    quantile,
)

BOUNDS = (0.1, 0.5, 1.0, 5.0)


def router_text(ttft: list[float], itl: list[float]) -> str:
    registry = CollectorRegistry()
    h = Histogram("tandem_router_ttft_seconds", "", ["route"], buckets=BOUNDS, registry=registry)
    i = Histogram("tandem_router_inter_token_seconds", "", ["route"], buckets=BOUNDS, registry=registry)
    for v in ttft:
        h.labels("/v1/chat/completions").observe(v)
    for v in itl:
        i.labels("/v1/completions").observe(v)
    return generate_latest(registry).decode()


def queued_text(by_priority: dict[int, float]) -> str:
    registry = CollectorRegistry()
    gauge = Gauge(FLOW_QUEUED, "", ["priority"], registry=registry)
    for priority, n in by_priority.items():
        gauge.labels(str(priority)).set(n)
    return router_text([0.05], []) + generate_latest(registry).decode()


def test_requests_held_in_the_routers_queues_are_read_by_priority_and_summed() -> None:
    a = parse_router(queued_text({0: 3, 10: 1}))
    b = parse_router(queued_text({0: 2, -5: 4}))
    assert a.queued == {0: 3, 10: 1}
    assert combine([a, b]).queued == {0: 5, 10: 1, -5: 4}
    assert parse_router(router_text([0.05], [])).queued == {}  # flow control off: nothing held


def test_the_router_exports_the_queue_under_the_name_read() -> None:
    from tandem_router import flow_control

    assert f'"{FLOW_QUEUED}"' in Path(flow_control.__file__).read_text()


def test_quantile_interpolates_like_prometheus() -> None:
    # 10 observations: 5 in (0, 0.1], 5 in (0.1, 0.5]: p90 is rank 9, 4/5 into the second bucket
    buckets = {0.1: 5.0, 0.5: 10.0, 1.0: 10.0, float("inf"): 10.0}
    assert quantile(0.9, buckets) == pytest.approx(0.1 + 0.4 * 4 / 5)
    assert quantile(0.9, {0.1: 0.0, float("inf"): 0.0}) is None
    assert quantile(0.9, {0.1: 0.0, float("inf"): 3.0}) == 0.1  # in +Inf: the highest finite bound


def test_the_interval_p90_ignores_what_came_before() -> None:
    before = parse_router(router_text([4.0] * 100, []))
    now = parse_router(router_text([4.0] * 100 + [0.05] * 10, [0.01]))
    p90 = quantile(0.9, interval_buckets(now.ttft, before.ttft))
    assert p90 is not None
    assert p90 <= 0.1


def test_a_restarted_router_counts_from_zero() -> None:
    before = parse_router(router_text([0.05] * 100, []))
    now = parse_router(router_text([2.0] * 3, []))
    assert interval_buckets(now.ttft, before.ttft) == now.ttft


def test_replicas_are_summed() -> None:
    a = parse_router(router_text([0.05] * 3, [0.2]))
    b = parse_router(router_text([0.05] * 7, []))
    both = combine([a, b])
    assert both.ttft[float("inf")] == 10
    assert both.itl[float("inf")] == 1


def test_worker_gauges_and_a_missing_one() -> None:
    registry = CollectorRegistry()
    for name, value in [("num_queue_reqs", 3), ("token_usage", 0.5), ("num_running_reqs", 7), ("gen_throughput", 900)]:
        Gauge(f"sglang:{name}", "", ["tp_rank"], registry=registry).labels("0").set(value)
    gauges = parse_worker(generate_latest(registry).decode())
    assert gauges is not None
    assert (gauges.queue_reqs, gauges.token_usage, gauges.running_reqs, gauges.gen_throughput) == (3, 0.5, 7, 900)
    assert parse_worker("# nothing here\n") is None
