"""A real Prometheus (Debian package) scraping loopback targets, with the chart's alert rules loaded."""

from __future__ import annotations

import re
import shutil
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import aiohttp
import yaml

from tandem.procs import ManagedProcess, free_port
from tests.chart.stack import CHART

ALERTS = CHART / "alerts" / "tandem-rules.yaml"


def rules_file(path: Path) -> Path:
    """The chart's alert list (what templates/monitoring.yaml embeds in the PrometheusRule) as a rules file."""
    rules = yaml.safe_load(ALERTS.read_text())
    path.write_text(yaml.safe_dump({"groups": [{"name": "tandem", "interval": "1s", "rules": rules}]}))
    return path


def binary(name: str) -> str:
    found = shutil.which(name)
    assert found, f"{name} not found: scripts/bootstrap.sh installs the Debian package 'prometheus'"
    return found


def _label_name(key: str) -> str:
    """A Kubernetes label key as Prometheus' service discovery names it (invalid characters become ``_``)."""
    return re.sub(r"[^a-zA-Z0-9_]", "_", key)


def pod_monitor_scrape_config(monitor: dict[str, Any], kubeconfig: Path) -> dict[str, Any]:
    """What the Prometheus Operator generates for a ``PodMonitor`` (its first endpoint): Kubernetes pod discovery,
    kept by the selector's labels and the named container port, with ``namespace`` and ``pod`` target labels."""
    spec = monitor["spec"]
    endpoint = spec["podMetricsEndpoints"][0]
    keep = [
        {
            "source_labels": [f"__meta_kubernetes_pod_label_{_label_name(key)}"],
            "regex": re.escape(str(value)),
            "action": "keep",
        }
        for key, value in spec["selector"]["matchLabels"].items()
    ]
    keep.append(
        {"source_labels": ["__meta_kubernetes_pod_container_port_name"], "regex": endpoint["port"], "action": "keep"}
    )
    targets = [
        {"source_labels": ["__meta_kubernetes_namespace"], "target_label": "namespace"},
        {"source_labels": ["__meta_kubernetes_pod_name"], "target_label": "pod"},
    ]
    discovery: dict[str, Any] = {"role": "pod", "kubeconfig_file": str(kubeconfig)}
    names = (spec.get("namespaceSelector") or {}).get("matchNames")
    if names:
        discovery["namespaces"] = {"names": list(names)}
    meta = monitor["metadata"]
    return {
        "job_name": f"podMonitor/{meta['namespace']}/{meta['name']}/0",
        "metrics_path": endpoint.get("path", "/metrics"),
        "kubernetes_sd_configs": [discovery],
        "relabel_configs": [*keep, *targets],
    }


@dataclass
class Prometheus:
    url: str
    proc: ManagedProcess

    @classmethod
    def start(
        cls,
        tmp_path: Path,
        targets: dict[str, str],
        procs: list[ManagedProcess],
        scrape_configs: Sequence[dict[str, Any]] = (),
    ) -> Prometheus:
        """Scrape ``job -> host:port`` (and ``scrape_configs``) every second; loopback only."""
        tmp_path.mkdir(parents=True, exist_ok=True)
        static = [{"job_name": job, "static_configs": [{"targets": [target]}]} for job, target in targets.items()]
        config = {
            "global": {"scrape_interval": "1s", "evaluation_interval": "1s"},
            "rule_files": [str(rules_file(tmp_path / "tandem-rules.yaml"))],
            "scrape_configs": [*static, *scrape_configs],
        }
        (tmp_path / "prometheus.yml").write_text(yaml.safe_dump(config))
        port = free_port()
        argv = [
            binary("prometheus"),
            f"--config.file={tmp_path / 'prometheus.yml'}",
            f"--storage.tsdb.path={tmp_path / 'tsdb'}",
            f"--web.listen-address=127.0.0.1:{port}",
        ]
        proc = ManagedProcess("prometheus", argv, tmp_path / "prometheus.log").start()
        procs.append(proc)
        url = f"http://127.0.0.1:{port}"
        proc.wait_http(f"{url}/-/ready", timeout=60)
        return cls(url, proc)

    async def _get(self, path: str, **params: str) -> Any:
        async with aiohttp.ClientSession() as http, http.get(f"{self.url}{path}", params=params) as resp:
            body = await resp.json()
        assert body["status"] == "success", body
        return body["data"]

    async def query(self, expr: str) -> list[dict[str, Any]]:
        data = await self._get("/api/v1/query", query=expr)
        result: list[dict[str, Any]] = data["result"]
        return result

    async def targets(self) -> list[dict[str, Any]]:
        data = await self._get("/api/v1/targets")
        active: list[dict[str, Any]] = data["activeTargets"]
        return active

    async def targets_up(self) -> dict[str, str]:
        data = await self._get("/api/v1/targets")
        return {t["labels"]["job"]: t["health"] for t in data["activeTargets"]}

    async def alerts(self) -> dict[str, str]:
        """alertname -> state (pending/firing) of the active alerts."""
        data = await self._get("/api/v1/alerts")
        return {a["labels"]["alertname"]: a["state"] for a in data["alerts"]}
