"""The router's own Prometheus metrics, scraped by tests that must see what the router saw (streams in flight
on a worker, retries by reason, failed attempts per worker), parsed with prometheus_client's own parser."""

from __future__ import annotations

from collections import Counter
from dataclasses import dataclass, field

import aiohttp
from prometheus_client.parser import text_string_to_metric_families


@dataclass
class RouterMetrics:
    in_flight: dict[str, float] = field(default_factory=dict)  # worker url -> requests in flight (all it knows)
    retries: Counter[str] = field(default_factory=Counter)  # reason -> retries on another pair
    failures: Counter[str] = field(default_factory=Counter)  # worker url -> failed attempts that involved it
    requests: float = 0  # requests in flight (each holds one prefill)
    first_bytes: float = 0  # responses whose first byte was relayed ...
    ended: float = 0  # ... and those of them that ended since: the difference is streams in flight
    stream_errors: float = 0  # streams ended by an error event after their first byte
    resumed: Counter[str] = field(default_factory=Counter)  # reason -> streams resumed on a fresh pair
    resumed_routes: Counter[str] = field(default_factory=Counter)  # route -> streams resumed on a fresh pair
    refused: Counter[tuple[str, str]] = field(default_factory=Counter)  # (route, reason) -> broken, not resumed
    resume_gaps: float = 0  # resume gaps observed (one per resume)
    detections: float = 0  # integrity detector findings
    forged_endpoints: float = 0  # registry values ignored for lack of a valid operator signature
    registry_panic: float = 0  # 1 while a registry removal storm is held
    registry_held: float = 0  # workers the registry removed that the router keeps routing to
    registry_panics: float = 0  # storms held since start
    registry_released: float = 0  # held workers removed after all (failed checks, or a settled registry)
    available: dict[str, float] = field(default_factory=dict)  # worker url -> 1 if its breaker admits traffic
    schemas: dict[str, float] = field(default_factory=dict)  # relation -> registry entries (older/current/newer/...)
    refused_entries: Counter[str] = field(default_factory=Counter)  # reason -> registry values refused
    gc_collections: Counter[str] = field(default_factory=Counter)  # generation -> the process's cycle collections

    @property
    def streaming(self) -> float:
        return self.first_bytes - self.ended

    @property
    def before_first_byte(self) -> float:
        return self.requests - self.streaming


async def scrape(router_url: str) -> RouterMetrics:
    async with aiohttp.ClientSession() as http, http.get(f"{router_url}/metrics") as resp:
        text = await resp.text()
    out = RouterMetrics()
    for family in text_string_to_metric_families(text):
        for sample in family.samples:
            if sample.name == "tandem_router_worker_in_flight":
                out.in_flight[sample.labels["worker"]] = sample.value
                if sample.labels["role"] == "prefill":
                    out.requests += sample.value
            elif sample.name == "tandem_router_retries_total":
                out.retries[sample.labels["reason"]] += int(sample.value)
            elif sample.name == "tandem_router_pair_failures_total":
                for role in ("prefill", "decode"):
                    out.failures[sample.labels[role]] += int(sample.value)
            elif sample.name == "tandem_router_ttft_seconds_count":
                out.first_bytes += sample.value
            elif sample.name == "tandem_router_e2e_seconds_count":
                out.ended += sample.value
            elif sample.name == "tandem_router_stream_errors_total":
                out.stream_errors += sample.value
            elif sample.name == "tandem_router_resumed_streams_total":
                out.resumed[sample.labels["reason"]] += int(sample.value)
                out.resumed_routes[sample.labels["route"]] += int(sample.value)
            elif sample.name == "python_gc_collections_total":
                out.gc_collections[sample.labels["generation"]] += int(sample.value)
            elif sample.name == "tandem_router_resume_refused_total":
                out.refused[sample.labels["route"], sample.labels["reason"]] += int(sample.value)
            elif sample.name == "tandem_router_resume_gap_seconds_count":
                out.resume_gaps += sample.value
            elif sample.name == "tandem_integrity_detections_total":
                out.detections += sample.value
            elif sample.name == "tandem_router_registry_forged_endpoints_total":
                out.forged_endpoints += sample.value
            elif sample.name == "tandem_router_registry_panic":
                out.registry_panic = sample.value
            elif sample.name == "tandem_router_registry_held_workers":
                out.registry_held = sample.value
            elif sample.name == "tandem_router_registry_panics_total":
                out.registry_panics = sample.value
            elif sample.name == "tandem_router_registry_held_released_total":
                out.registry_released = sample.value
            elif sample.name == "tandem_router_worker_available":
                out.available[sample.labels["worker"]] = sample.value
            elif sample.name == "tandem_router_registry_entries_by_schema":
                out.schemas[sample.labels["relation"]] = sample.value
            elif sample.name == "tandem_router_registry_refused_entries_total":
                out.refused_entries[sample.labels["reason"]] += int(sample.value)
    return out
