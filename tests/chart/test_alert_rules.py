"""The chart's alerts under ``promtool test rules``: the KV-transfer-failure alert fires on a worker whose
``sglang:num_transfer_failed_reqs_total`` keeps rising for 5 minutes, and only on that worker."""

from __future__ import annotations

import subprocess
from pathlib import Path

import yaml

from tests.chart.prom import binary, rules_file

FAILING = 'sglang:num_transfer_failed_reqs_total{namespace="serving",pod="kimi-prefill-0-0",model_name="kimi"}'
HEALTHY = 'sglang:num_transfer_failed_reqs_total{namespace="serving",pod="kimi-prefill-1-0",model_name="kimi"}'


def test_kv_transfer_failure_alert_fires_for_the_failing_worker(tmp_path: Path) -> None:
    rules = rules_file(tmp_path / "rules.yaml")
    alert = {
        "exp_labels": {"severity": "warning", "namespace": "serving", "pod": "kimi-prefill-0-0"},
        "exp_annotations": {
            "summary": "SGLang worker kimi-prefill-0-0 reports failed KV transfers",
            "description": "Mooncake KV transfers between prefill and decode fail; check RDMA devices and peer health.",
        },
    }
    tests = {
        "rule_files": [str(rules)],
        "evaluation_interval": "30s",
        "tests": [
            {
                "interval": "30s",
                "input_series": [
                    {"series": FAILING, "values": "0+2x30"},  # two failed transfers every 30 s for 15 min
                    {"series": HEALTHY, "values": "0x30"},
                ],
                "alert_rule_test": [
                    {"eval_time": "3m", "alertname": "TandemKVTransferFailures", "exp_alerts": []},  # pending
                    {"eval_time": "10m", "alertname": "TandemKVTransferFailures", "exp_alerts": [alert]},
                ],
            }
        ],
    }
    path = tmp_path / "alerts-test.yaml"
    path.write_text(yaml.safe_dump(tests))
    out = subprocess.run(
        [binary("promtool"), "test", "rules", str(path)], capture_output=True, text=True, timeout=60, check=False
    )
    assert out.returncode == 0, out.stdout + out.stderr
    assert "SUCCESS" in out.stdout
