"""The Grafana dashboard, as data: every panel's PromQL lives here, so tests can run each query against a real
Prometheus and ``make generate`` writes the JSON the chart ships (``charts/tandem/dashboards/tandem.json``)."""

from __future__ import annotations

import json
from dataclasses import dataclass


@dataclass(frozen=True)
class Panel:
    title: str
    expr: str
    legend: str
    unit: str


PANELS: tuple[Panel, ...] = (
    Panel(
        "Requests per second by status",
        "sum by (status) (rate(tandem_router_requests_total[1m]))",
        "{{status}}",
        "reqps",
    ),
    Panel(
        "Time to first token p50 / p99",
        "histogram_quantile(0.99, sum by (le) (rate(tandem_router_ttft_seconds_bucket[5m]))) or "
        "histogram_quantile(0.5, sum by (le) (rate(tandem_router_ttft_seconds_bucket[5m])))",
        "ttft",
        "s",
    ),
    Panel(
        "Inter-token latency p99",
        "histogram_quantile(0.99, sum by (le) (rate(tandem_router_inter_token_seconds_bucket[5m])))",
        "itl p99",
        "s",
    ),
    Panel(
        "End-to-end latency p99",
        "histogram_quantile(0.99, sum by (le) (rate(tandem_router_e2e_seconds_bucket[5m])))",
        "e2e p99",
        "s",
    ),
    Panel("Requests in flight per worker", "sum by (worker) (tandem_router_worker_in_flight)", "{{worker}}", "short"),
    Panel("Available workers by role", "sum by (role) (tandem_router_worker_available)", "{{role}}", "short"),
    Panel(
        "Retries on a fresh pair",
        "sum by (reason) (increase(tandem_router_retries_total[5m]))",
        "{{reason}}",
        "short",
    ),
    Panel(
        "Failures per prefill/decode pair",
        "sum by (prefill, decode) (increase(tandem_router_pair_failures_total[5m]))",
        "{{prefill}} -> {{decode}}",
        "short",
    ),
    Panel(
        "Operator: fencing events by reason",
        "sum by (reason) (increase(tandem_operator_fences_total[5m]))",
        "{{reason}}",
        "short",
    ),
    Panel(
        "Operator: group recoveries",
        "sum(increase(tandem_operator_recovery_seconds_count[15m]))",
        "recoveries",
        "short",
    ),
    Panel(
        "Operator: recovery duration p50 / p99 (death to re-registered)",
        "histogram_quantile(0.99, sum by (le) (rate(tandem_operator_recovery_seconds_bucket[15m]))) or "
        "histogram_quantile(0.5, sum by (le) (rate(tandem_operator_recovery_seconds_bucket[15m])))",
        "recovery",
        "s",
    ),
    Panel(
        "Operator: fence latency p99 (pod event to registry key deleted)",
        "histogram_quantile(0.99, sum by (le) (rate(tandem_operator_fence_seconds_bucket[15m])))",
        "fence p99",
        "s",
    ),
    Panel("Operator: leader", "sum(tandem_operator_leader)", "leaders", "short"),
)


def dashboard_json() -> str:
    panels = []
    for i, panel in enumerate(PANELS):
        panels.append(
            {
                "id": i + 1,
                "type": "timeseries",
                "title": panel.title,
                "datasource": {"type": "prometheus", "uid": "${datasource}"},
                "gridPos": {"h": 8, "w": 12, "x": 12 * (i % 2), "y": 8 * (i // 2)},
                "fieldConfig": {"defaults": {"unit": panel.unit}, "overrides": []},
                "targets": [{"refId": "A", "expr": panel.expr, "legendFormat": panel.legend}],
            }
        )
    doc = {
        "title": "Tandem — PD serving",
        "uid": "tandem-pd",
        "schemaVersion": 39,
        "version": 1,
        "time": {"from": "now-1h", "to": "now"},
        "refresh": "30s",
        "tags": ["tandem", "sglang", "mooncake"],
        "templating": {
            "list": [{"name": "datasource", "type": "datasource", "query": "prometheus", "label": "Prometheus"}]
        },
        "panels": panels,
    }
    return json.dumps(doc, indent=2) + "\n"
