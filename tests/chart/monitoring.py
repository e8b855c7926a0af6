"""The monitoring phase of the chart lifecycle test: a real Prometheus scrapes the running router and operator,
traffic and one worker death produce every kind of sample, and every dashboard panel query returns data."""

from __future__ import annotations

import asyncio
import collections
import signal
import subprocess
import time
from collections.abc import Callable, Coroutine
from pathlib import Path
from typing import Any
from urllib.parse import urlsplit

import aiohttp
from kubernetes_asyncio import client
from openai import AsyncOpenAI, OpenAIError
from prometheus_client.parser import text_string_to_metric_families

from tandem_dev.chart.dashboard import PANELS
from tandem_dev.devcluster.podrunner import PodRunner
from tandem_dev.procs import ManagedProcess
from tests.chart.prom import Prometheus, binary, rules_file
from tests.tandem_dev.devcluster.devcluster_fixtures import eventually

DECODE_LEADER = "sim-decode-0-0"
# Panels whose value must be positive after this phase, not just present.
POSITIVE = {
    "sum by (status) (rate(tandem_router_requests_total[1m]))",
    "sum by (reason) (increase(tandem_operator_fences_total[5m]))",
    "sum(increase(tandem_operator_recovery_seconds_count[15m]))",
}
# Requests kept in flight through the cut pair: more than the router keeps idle connections to the decode (one per
# concurrent use: sequential traffic and the health checker's probes). Each gives up after the SDK timeout, longer
# than the router's connect timeout (2 s) and its first retry's backoff.
FAILING_CONCURRENCY = 3
FAILING_REQUEST_TIMEOUT_S = 10
FAILING_WITHIN_S = 30  # the cut decode stays in rotation ~20 s (readiness probes, the router's health probes)


def check_alert_rules(tmp_path: Path) -> str:
    """``promtool check rules`` on the chart's alerts (as templates/monitoring.yaml embeds them)."""
    out = subprocess.run(
        [binary("promtool"), "check", "rules", str(rules_file(tmp_path / "rules-check.yaml"))],
        capture_output=True,
        text=True,
        timeout=60,
        check=False,
    )
    assert out.returncode == 0, out.stdout + out.stderr
    return out.stdout


async def _traffic(router_url: str, model: str, requests: int) -> None:
    """Plain and streamed completions (streaming feeds the inter-token histogram)."""
    async with AsyncOpenAI(base_url=f"{router_url}/v1", api_key="none", max_retries=0, timeout=30) as sdk:
        for i in range(requests):
            if i % 2:
                stream = await sdk.completions.create(model=model, prompt=f"stream {i}", max_tokens=8, stream=True)
                chunks = [chunk async for chunk in stream]
                assert chunks
            else:
                await sdk.completions.create(model=model, prompt=f"plain {i}", max_tokens=8)


async def _failure_counts(router_url: str, decode_url: str) -> tuple[float, float]:
    """The router's own counts, from its /metrics: failed attempts on pairs with ``decode_url``, and retries after a
    decode's failure."""
    async with aiohttp.ClientSession() as http, http.get(f"{router_url}/metrics") as resp:
        assert resp.status == 200, resp.status
        text = await resp.text()
    failures = retries = 0.0
    for family in text_string_to_metric_families(text):
        for sample in family.samples:
            if sample.name == "tandem_router_pair_failures_total" and sample.labels.get("decode") == decode_url:
                failures += sample.value
            elif sample.name == "tandem_router_retries_total" and sample.labels["reason"].startswith("decode_"):
                retries += sample.value
    return failures, retries


async def _failing_requests(router_url: str, model: str, decode_url: str, before: tuple[float, float]) -> list[str]:
    """Completions through the router while the decode's link is cut, ``FAILING_CONCURRENCY`` at a time, until the
    router counts a failed attempt on the pair and a retry (``before``: its counts when the link was cut); then the
    ones in flight finish. Returns what the client got from each.

    Concurrent, because one request alone can miss the pair: the router may send it on a kept-alive connection to
    the decode (its health probes keep one warm), where it waits for an answer that cannot come (the worker's
    first byte may legitimately take minutes) until the client gives up. That is no failure of the pair (nothing
    is counted when a client leaves), and by the time the next one is sent the decode may be out of rotation (its
    pod NotReady, or its breaker open after failed health probes): a 503 "no healthy pair", no attempt. The decode
    has fewer idle connections than requests in flight, so one of them connects afresh and fails within the
    connect timeout."""
    outcomes: list[str] = []
    in_flight: set[asyncio.Task[None]] = set()
    async with AsyncOpenAI(
        base_url=f"{router_url}/v1", api_key="none", max_retries=0, timeout=FAILING_REQUEST_TIMEOUT_S
    ) as sdk:

        async def request() -> None:
            try:
                await sdk.completions.create(model=model, prompt="after the cut", max_tokens=4)
            except OpenAIError as err:
                outcomes.append(f"{type(err).__name__}: {str(err)[:120]}")
            else:
                outcomes.append("served")

        async def counted() -> tuple[float, float] | None:
            in_flight.difference_update([task for task in in_flight if task.done()])
            while len(in_flight) < FAILING_CONCURRENCY:
                in_flight.add(asyncio.create_task(request()))
            counts = await _failure_counts(router_url, decode_url)
            return counts if all(now > then for now, then in zip(counts, before, strict=True)) else None

        try:
            await eventually(
                counted, "the router to count a failed attempt on the cut pair and a retry", within=FAILING_WITHIN_S
            )
        except AssertionError:
            for task in in_flight:
                task.cancel()
            await asyncio.gather(*in_flight, return_exceptions=True)
            after = await _failure_counts(router_url, decode_url)
            raise AssertionError(
                f"the router counted no failed attempt on a pair with the cut decode {decode_url} and a retry "
                f"within {FAILING_WITHIN_S} s: (pair failures, retries) {before} -> {after}; "
                f"{len(outcomes)} requests answered: "
                f"{dict(collections.Counter(outcomes))}"
            ) from None
        await asyncio.gather(*in_flight)  # each ends within the SDK timeout
    return outcomes


async def _recoveries(api: client.ApiClient, namespace: str) -> int | None:
    obj = await client.CustomObjectsApi(api).get_namespaced_custom_object(
        "tandem.dev", "v1alpha1", namespace, "pdclusters", "sim"
    )
    count = int((obj.get("status") or {}).get("recoveries") or 0)
    return count or None


async def exercise_and_query(
    tmp_path: Path,
    procs: list[ManagedProcess],
    api: client.ApiClient,
    namespace: str,
    runner: PodRunner,
    router_url: str,
    operator_url: str,
    model: str,
    serves: Callable[[], Coroutine[Any, Any, bool]],
) -> dict[str, float]:
    """Returns measured times. Fails if any panel query returns no data."""
    times: dict[str, float] = {}
    print(check_alert_rules(tmp_path))
    targets = {"router": urlsplit(router_url).netloc, "operator": urlsplit(operator_url).netloc}
    prom = await asyncio.to_thread(Prometheus.start, tmp_path / "prometheus", targets, procs)
    await eventually(lambda: _all_up(prom), "both scrape targets up", within=30)
    await _traffic(router_url, model, 20)

    # A decode leader's network goes (its link cut; pod and process stay): the router's attempts on that pair fail
    # (connect timeouts). Then its worker dies: the pod runner reports what a kubelet would (container terminated,
    # pod Failed under restartPolicy Never), and the operator fences the group, recreates it, registers it again.
    ((leader, crashed),) = [
        (launch, proc) for launch, proc in runner.running.values() if launch.pod.endswith(f"/{DECODE_LEADER}")
    ]
    decode_url = f"http://{leader.host}:{leader.port}"
    before = await _failure_counts(router_url, decode_url)
    runner.sandbox(f"{namespace}/{DECODE_LEADER}").cut_link()
    outcomes = await _failing_requests(router_url, model, decode_url, before)
    print(f"requests through the cut pair: {dict(collections.Counter(outcomes))}")
    assert outcomes, "no request through the cut pair was answered"
    assert "served" not in outcomes, outcomes  # the group's only decode is cut off
    began = time.monotonic()
    crashed.signal(signal.SIGKILL)
    await eventually(lambda: _recoveries(api, namespace), "the operator's recovery of the decode group", within=90)
    await eventually(serves, "completions after the recovery", within=60)
    times["worker killed to serving again"] = time.monotonic() - began
    await _traffic(router_url, model, 10)

    async def every_panel_has_data() -> dict[str, list[dict[str, Any]]] | None:
        """Every panel answers, and those that must be positive are (a scrape after the recovery has landed)."""
        results = {panel.expr: await prom.query(panel.expr) for panel in PANELS}
        if any(not r for r in results.values()):
            return None
        positive = [max(float(sample["value"][1]) for sample in results[expr]) for expr in POSITIVE]
        return results if all(value > 0 for value in positive) else None

    began = time.monotonic()
    try:
        results = await eventually(every_panel_has_data, "every panel query to return data", within=30)
    except AssertionError:
        answers = {panel.title: (panel.expr, await prom.query(panel.expr)) for panel in PANELS}
        empty = [title for title, (_, answer) in answers.items() if not answer]
        zero = [
            t
            for t, (expr, a) in answers.items()
            if a and expr in POSITIVE and not any(float(x["value"][1]) > 0 for x in a)
        ]
        raise AssertionError(f"panels without data: {empty}; panels that must be positive but are 0: {zero}") from None
    times["last scrape to every panel with data"] = time.monotonic() - began
    for panel in PANELS:
        values = [float(sample["value"][1]) for sample in results[panel.expr]]
        print(f"panel {panel.title!r}: {values}")
        if panel.expr in POSITIVE:
            assert max(values) > 0, (panel.title, values)
    alerts = await eventually(lambda: _alerts_with(prom, "TandemFencingEvents"), "the fencing alert", within=15)
    print(f"alerts: {alerts}")
    return times


async def _all_up(prom: Prometheus) -> bool:
    health = await prom.targets_up()
    return set(health) == {"router", "operator"} and set(health.values()) == {"up"}


async def _alerts_with(prom: Prometheus, name: str) -> dict[str, str] | None:
    alerts = await prom.alerts()
    return alerts if name in alerts else None
