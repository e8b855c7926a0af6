"""The operator bench's reading of the API server's request counters and of Events."""

from __future__ import annotations

from typing import Any

from tandem_dev.operator.bench_apiserver import count_events, parse_requests, tables

METRICS = """\
# HELP apiserver_request_total Counter of apiserver requests
# TYPE apiserver_request_total counter
apiserver_request_total{code="201",resource="pods",scope="resource",subresource="",verb="POST"} 40
apiserver_request_total{code="409",resource="pods",scope="resource",subresource="",verb="POST"} 2
apiserver_request_total{code="200",resource="pods",scope="resource",subresource="status",verb="PATCH"} 1.2e+02
apiserver_request_total{code="200",resource="nodes",scope="cluster",subresource="",verb="WATCH"} 3
apiserver_request_duration_seconds_count{resource="pods",verb="POST"} 99
"""


def test_requests_are_summed_per_verb_and_resource_over_codes() -> None:
    counts = parse_requests(METRICS)
    assert counts == {("POST", "pods"): 42, ("PATCH", "pods/status"): 120, ("WATCH", "nodes"): 3}


def test_events_count_repeats_and_fall_back_to_the_legacy_source() -> None:
    items: list[dict[str, Any]] = [
        {"reportingComponent": "default-scheduler", "reason": "Scheduled"},
        {"reportingComponent": "", "source": {"component": "node-controller"}, "reason": "RegisteredNode", "count": 3},
        {"reason": "Odd"},
    ]
    counts = count_events(items)
    assert counts == {("default-scheduler", "Scheduled"): 1, ("node-controller", "RegisteredNode"): 3, ("?", "Odd"): 1}
    requests, events = tables("10 groups", parse_requests(METRICS), counts)
    assert requests.rows[0] == ["PATCH", "pods/status", 120]
    assert "165 requests in all" in requests.notes[0]
    assert "5 Events in all" in events.notes[0]
