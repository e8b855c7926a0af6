"""Worker metrics on the real control plane: a real Prometheus scrapes the targets the chart's worker PodMonitor
selects -- the pods matching its selector, listed through the API server, at their IP and named port (Debian's
Prometheus has no Kubernetes discovery) -- i.e. the simulated SGLang group leaders behind their pod IPs, not rank 1;
the KV-transfer-failure alert goes pending when the prefill's transfers fail (the simulator's fault injection).
That it then fires after its 5 minutes is checked by tests/chart/test_alert_rules.py (promtool)."""

from __future__ import annotations

import asyncio
import json
from typing import Any

import aiohttp
import pytest
import yaml

from tandem_dev.devcluster.cluster import DevCluster
from tests.chart.prom import Prometheus, file_sd_scrape_config, pod_monitor_targets
from tests.operator.live import CRDS, SIM_MODEL, Live, load_result, pods, run_tool, sim_stack, start_load
from tests.tandem_dev.devcluster.devcluster_fixtures import eventually

pytestmark = [pytest.mark.k8s, pytest.mark.netns, pytest.mark.timeout(300)]
CHART = CRDS.parent
KV_ALERT_EXPR = "sum by (namespace, pod) (increase(sglang:num_transfer_failed_reqs_total[5m])) > 0"


async def _pod_monitor(cluster: DevCluster, namespace: str) -> dict[str, Any]:
    _, out, _ = await run_tool(
        cluster,
        "helm",
        "template",
        "t",
        str(CHART),
        "--namespace",
        namespace,
        "--set",
        "metrics.workerPodMonitor.enabled=true",
        "--set",
        f"metrics.workerPodMonitor.namespaces={{{namespace}}}",
    )
    (monitor,) = [d for d in yaml.safe_load_all(out) if d and d["kind"] == "PodMonitor"]
    return dict(monitor)


async def test_prometheus_scrapes_worker_leaders_and_the_kv_failure_alert_triggers(
    live: Live,
) -> None:
    ns = live.ns
    monitor = await _pod_monitor(live.cluster, ns)
    groups = ["decode-0", "prefill-0"]
    async with sim_stack(live, groups) as sim:
        ips = {p.metadata.name: p.status.pod_ip for p in await pods(live.api, ns)}
        assert sorted(ips) == ["sim-decode-0-0", "sim-decode-0-1", "sim-prefill-0-0"]
        targets_file = live.tmp / "worker-targets.json"
        targets_file.write_text(json.dumps(await pod_monitor_targets(live.api, monitor)))
        endpoint = monitor["spec"]["podMetricsEndpoints"][0]
        config = file_sd_scrape_config("tandem-workers", targets_file, endpoint["path"])
        prom = await asyncio.to_thread(Prometheus.start, live.tmp / "prometheus", {}, live.procs, [config])

        async def leaders_scraped() -> list[dict[str, Any]] | None:
            targets = await prom.targets()
            up = sorted((t["labels"]["pod"], t["health"]) for t in targets)
            return targets if up == [("sim-decode-0-0", "up"), ("sim-prefill-0-0", "up")] else None

        targets = await eventually(leaders_scraped, "the two group leaders scraped (rank 1 left out)", within=60)
        for target in targets:
            assert ips[target["labels"]["pod"]] in target["scrapeUrl"]  # behind the pod's own IP
            assert target["labels"]["namespace"] == ns
        assert await prom.query(f'sglang:num_running_reqs{{namespace="{ns}",pod="sim-prefill-0-0"}}')

        url = f"http://{ips['sim-prefill-0-0']}:30000/tandem/sim/faults"
        async with aiohttp.ClientSession() as session, session.post(url, json={"transfer_failure_prob": 1.0}) as r:
            assert r.status == 200, await r.text()
        result = await load_result(await start_load(sim.base_url, SIM_MODEL, 4, 5.0), within=60)
        assert result["failed_before_first_byte"], result  # every transfer fails

        async def failing() -> list[dict[str, Any]] | None:
            return await prom.query(KV_ALERT_EXPR) or None

        series = await eventually(failing, "failed KV transfers in Prometheus", within=30)
        assert {s["metric"]["pod"] for s in series} <= {"sim-prefill-0-0", "sim-decode-0-0"}

        async def pending() -> dict[str, str] | None:
            alerts = await prom.alerts()
            return alerts if alerts.get("TandemKVTransferFailures") == "pending" else None

        await eventually(pending, "the KV-transfer-failure alert pending (fires after its 5 min)", within=30)
        print(f"\nscraped {[t['scrapeUrl'] for t in targets]}; failing series {series}")
