"""Worker metrics on the real control plane: a real Prometheus scrapes the targets the chart's worker PodMonitor
selects -- the pods matching its selector, listed through the API server, at their IP and named port (Debian's
Prometheus has no Kubernetes discovery) -- i.e. the simulated SGLang group leaders behind their pod IPs, not rank 1;
the KV-transfer-failure alert goes pending when the prefill's transfers fail (the simulator's fault injection).
That it then fires after its 5 minutes is checked by tests/chart/test_alert_rules.py (promtool)."""

from __future__ import annotations

import asyncio
import json
from pathlib import Path
from typing import Any

import aiohttp
import pytest
import yaml
from kubernetes_asyncio import client

from tandem.devcluster.cluster import DevCluster
from tandem.devcluster.podrunner import PodRunner
from tandem.procs import ManagedProcess, free_port
from tests.chart.prom import Prometheus, file_sd_scrape_config, pod_monitor_targets
from tests.devcluster_fixtures import eventually
from tests.operator.live import (
    CRDS,
    Registry,
    create_pdcluster,
    load_result,
    operator_process,
    pdcluster,
    pods,
    router_process,
    run_tool,
    start_load,
)

pytestmark = [pytest.mark.k8s, pytest.mark.timeout(300)]
CHART = CRDS.parent
MODEL = "kimi-k2.6-sim"
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
    k8s_cluster: DevCluster,
    k8s_api: client.ApiClient,
    k8s_namespace: str,
    tandem_crds: None,
    etcd_endpoint: str,
    tmp_path: Path,
    proc_factory: list[ManagedProcess],
) -> None:
    ns = k8s_namespace
    monitor = await _pod_monitor(k8s_cluster, ns)
    proc_factory.append(operator_process(k8s_cluster, ns, etcd_endpoint, tmp_path, "op-metrics").start())
    await create_pdcluster(k8s_api, ns, pdcluster("sim", simulated=True))
    (tmp_path / "pods").mkdir()
    async with (
        PodRunner(k8s_api, tmp_path / "pods", namespace=ns).running_in_background(),
        Registry(etcd_endpoint) as reg,
    ):

        async def registered() -> bool:
            return sorted(await reg.endpoints(ns, "sim")) == ["decode-0", "prefill-0"]

        await eventually(registered, "prefill-0 and decode-0 registered", within=90)
        ips = {p.metadata.name: p.status.pod_ip for p in await pods(k8s_api, ns)}
        assert sorted(ips) == ["sim-decode-0-0", "sim-decode-0-1", "sim-prefill-0-0"]
        targets_file = tmp_path / "worker-targets.json"
        targets_file.write_text(json.dumps(await pod_monitor_targets(k8s_api, monitor)))
        endpoint = monitor["spec"]["podMetricsEndpoints"][0]
        config = file_sd_scrape_config("tandem-workers", targets_file, endpoint["path"])
        prom = await asyncio.to_thread(Prometheus.start, tmp_path / "prometheus", {}, proc_factory, [config])

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
        port = free_port()
        proc_factory.append(router_process(etcd_endpoint, ns, "sim", port, tmp_path).start())
        await asyncio.sleep(2.0)  # the router has synced the registry
        result = await load_result(await start_load(f"http://127.0.0.1:{port}/v1", MODEL, 4, 5.0), within=60)
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
