"""Where the control plane's work goes during ``tandem bench operator``'s ramp: the API server's own request
counters (``apiserver_request_total``, by verb and resource, from its ``/metrics``) and the Events written, by
reporting component and reason.

Both are read before the create and after every group is registered; the tables show the difference.
"""

from __future__ import annotations

import json
import re
from collections import Counter
from collections.abc import Mapping, Sequence
from typing import Any

from kubernetes_asyncio import client

from tandem_dev.bench import Table

REQUEST_METRIC = "apiserver_request_total"
LABEL = re.compile(r'(\w+)="((?:[^"\\]|\\.)*)"')
TOP = 15  # rows per table


def parse_requests(text: str) -> Counter[tuple[str, str]]:
    """``apiserver_request_total`` summed per (verb, resource[/subresource]) over codes, scopes and clients."""
    counts: Counter[tuple[str, str]] = Counter()
    for line in text.splitlines():
        if not line.startswith(REQUEST_METRIC + "{"):
            continue
        labels_text, _, value = line.rpartition(" ")
        labels = dict(LABEL.findall(labels_text))
        resource = labels.get("resource", "")
        if labels.get("subresource"):
            resource += "/" + labels["subresource"]
        counts[(labels.get("verb", ""), resource)] += int(float(value))
    return counts


async def apiserver_requests(api: client.ApiClient) -> Counter[tuple[str, str]]:
    response: Any = await api.call_api("/metrics", "GET", _preload_content=False, auth_settings=["BearerToken"])
    return parse_requests((await response.read()).decode())


def count_events(items: Sequence[Mapping[str, Any]]) -> Counter[tuple[str, str]]:
    """core/v1 Events per (reporting component, reason), each counted ``count`` times (a repeated Event is
    written as an update of one object)."""
    counts: Counter[tuple[str, str]] = Counter()
    for event in items:
        source = event.get("reportingComponent") or (event.get("source") or {}).get("component") or "?"
        counts[(source, event.get("reason") or "?")] += int(event.get("count") or 1)
    return counts


async def events(api: client.ApiClient) -> Counter[tuple[str, str]]:
    response: Any = await client.CoreV1Api(api).list_event_for_all_namespaces(_preload_content=False)
    return count_events(json.loads(await response.read())["items"])


def tables(title: str, requests: Counter[tuple[str, str]], events_written: Counter[tuple[str, str]]) -> list[Table]:
    """The busiest (verb, resource) pairs and Event sources between two readings."""
    total = sum(requests.values())
    request_rows: list[Sequence[object]] = [[v, r, n] for (v, r), n in requests.most_common(TOP)]
    event_rows: list[Sequence[object]] = [[s, r, n] for (s, r), n in events_written.most_common(TOP)]
    return [
        Table(
            f"{title}: API server requests, create -> all registered",
            ["verb", "resource", "requests"],
            request_rows,
            notes=[f"{total} requests in all (apiserver_request_total, every client); the {TOP} largest shown"],
        ),
        Table(
            f"{title}: Events written, create -> all registered",
            ["reporting component", "reason", "events"],
            event_rows,
            notes=[f"{sum(events_written.values())} Events in all (core/v1, counting repeats)"],
        ),
    ]
