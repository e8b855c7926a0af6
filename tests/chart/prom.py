"""A real Prometheus (Debian package) scraping loopback targets, with the chart's alert rules loaded."""

from __future__ import annotations

import shutil
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any

import aiohttp
import yaml

from tandem_dev.procs import ManagedProcess, free_port
from tests.chart.render import CHART

if TYPE_CHECKING:  # imported where used: the pure promtool test imports this module too (~0.8 s CPU)
    from kubernetes_asyncio import client

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


async def pod_monitor_targets(api: client.ApiClient, monitor: dict[str, Any]) -> list[dict[str, Any]]:
    """The scrape targets the Prometheus Operator derives from a ``PodMonitor`` (its first endpoint), as a
    ``file_sd`` list: pods matching its label selector in its namespaces, at their IP and the named container port,
    labelled ``namespace`` and ``pod``. (Debian's Prometheus is built without Kubernetes service discovery, so the
    test lists the pods through the API server with the same selector.)"""
    from kubernetes_asyncio import client

    spec = monitor["spec"]
    port_name = spec["podMetricsEndpoints"][0]["port"]
    selector = ",".join(f"{k}={v}" for k, v in spec["selector"]["matchLabels"].items())
    core = client.CoreV1Api(api)
    names = (spec.get("namespaceSelector") or {}).get("matchNames")
    listings = (
        [await core.list_namespaced_pod(ns, label_selector=selector) for ns in names]
        if names
        else [await core.list_pod_for_all_namespaces(label_selector=selector)]
    )
    groups = []
    for pod in (p for listing in listings for p in listing.items):
        ports = [p.container_port for c in pod.spec.containers for p in c.ports or () if p.name == port_name]
        if pod.status.pod_ip and ports:
            labels = {"namespace": pod.metadata.namespace, "pod": pod.metadata.name}
            groups.append({"targets": [f"{pod.status.pod_ip}:{ports[0]}"], "labels": labels})
    return groups


def file_sd_scrape_config(job: str, path: Path, metrics_path: str = "/metrics") -> dict[str, Any]:
    return {
        "job_name": job,
        "metrics_path": metrics_path,
        "file_sd_configs": [{"files": [str(path)], "refresh_interval": "1s"}],
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
