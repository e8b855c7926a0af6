"""A real Prometheus (Debian package) scraping loopback targets, with the chart's alert rules loaded."""

from __future__ import annotations

import shutil
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


@dataclass
class Prometheus:
    url: str
    proc: ManagedProcess

    @classmethod
    def start(cls, tmp_path: Path, targets: dict[str, str], procs: list[ManagedProcess]) -> Prometheus:
        """Scrape ``job -> host:port`` every second; loopback only."""
        tmp_path.mkdir(parents=True, exist_ok=True)
        config = {
            "global": {"scrape_interval": "1s", "evaluation_interval": "1s"},
            "rule_files": [str(rules_file(tmp_path / "tandem-rules.yaml"))],
            "scrape_configs": [
                {"job_name": job, "static_configs": [{"targets": [target]}]} for job, target in targets.items()
            ],
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

    async def targets_up(self) -> dict[str, str]:
        data = await self._get("/api/v1/targets")
        return {t["labels"]["job"]: t["health"] for t in data["activeTargets"]}

    async def alerts(self) -> dict[str, str]:
        """alertname -> state (pending/firing) of the active alerts."""
        data = await self._get("/api/v1/alerts")
        return {a["labels"]["alertname"]: a["state"] for a in data["alerts"]}
