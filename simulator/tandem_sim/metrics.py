"""Prometheus metrics with SGLang 0.5.23's names, types and buckets (``observability/metrics_collector.py``).

Every metric carries SGLang's ``model_name`` label; the attributes are the children bound to this worker's model
name (bound once, which keeps ``labels()`` lookups off the per-token path, and exports every metric at zero).
``sglang:kv_transfer_total_mb`` is a histogram of the MB really written by Mooncake per request (its ``_sum`` is
the total moved).
"""

from __future__ import annotations

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram, generate_latest

LABELS = ("model_name",)


class Metrics:
    def __init__(self, model_name: str) -> None:
        self.registry = CollectorRegistry()
        r = self.registry

        def gauge(name: str, doc: str) -> Gauge:
            return Gauge(name, doc, LABELS, registry=r).labels(model_name)

        def counter(name: str, doc: str) -> Counter:
            return Counter(name, doc, LABELS, registry=r).labels(model_name)

        def histogram(name: str, doc: str, buckets: tuple[float, ...]) -> Histogram:
            return Histogram(name, doc, LABELS, registry=r, buckets=buckets).labels(model_name)

        self.num_running_reqs = gauge("sglang:num_running_reqs", "The number of running requests.")
        self.num_queue_reqs = gauge("sglang:num_queue_reqs", "The number of requests in the waiting queue.")
        self.kv_used_tokens = gauge("sglang:kv_used_tokens", "KV slots locked by running requests.")
        self.kv_available_tokens = gauge("sglang:kv_available_tokens", "Free KV slots.")
        self.token_usage = gauge("sglang:token_usage", "The token usage.")
        self.gen_throughput = gauge("sglang:gen_throughput", "The generation throughput (token/s).")
        self.num_prefill_bootstrap_queue_reqs = gauge(
            "sglang:num_prefill_bootstrap_queue_reqs", "Prefill requests waiting for decode's KV indices."
        )
        self.num_decode_transfer_queue_reqs = gauge(
            "sglang:num_decode_transfer_queue_reqs", "Decode requests waiting for their KV."
        )
        self.cache_hit_rate = gauge("sglang:cache_hit_rate", "The prefix cache hit rate.")
        self.cached_tokens = Counter(
            "sglang:cached_tokens_total",
            "Number of cached prompt tokens by source (device/host/storage).",
            (*LABELS, "cache_source"),
            registry=r,
        ).labels(model_name, "device")
        self.prompt_tokens = counter("sglang:prompt_tokens_total", "Number of prefill tokens processed.")
        self.generation_tokens = counter("sglang:generation_tokens_total", "Number of generation tokens processed.")
        self.num_requests = counter("sglang:num_requests_total", "The number of requests finished.")
        self.num_aborted_requests = counter("sglang:num_aborted_requests_total", "The number of aborted requests.")
        self.ttft = histogram(
            "sglang:time_to_first_token_seconds",
            "Histogram of time to first token in seconds.",
            (0.1, 0.2, 0.4, 0.6, 0.8, 1, 2, 4, 6, 8, 10, 20, 40, 60, 80, 120, 160),
        )
        self.inter_token_latency = histogram(
            "sglang:inter_token_latency_seconds",
            "Histogram of inter-token latency in seconds.",
            (0.002, 0.004, 0.006, 0.008, 0.01, 0.015, 0.02, 0.025, 0.03, 0.035, 0.04, 0.06, 0.08, 0.1, 0.2, 0.4),
        )
        self.e2e_latency = histogram(
            "sglang:e2e_request_latency_seconds",
            "Histogram of End-to-end request latency in seconds",
            (0.1, 0.2, 0.4, 0.6, 0.8, 1, 2, 4, 6, 8, 10, 20, 40, 60, 80, 120, 160),
        )
        self.kv_transfer_speed_gb_s = histogram(
            "sglang:kv_transfer_speed_gb_s",
            "Histogram of KV cache transfer speed in GB/s.",
            (0.1, 0.5, 1, 5, 10, 25, 50, 100, 200, 400),
        )
        self.kv_transfer_latency_ms = histogram(
            "sglang:kv_transfer_latency_ms",
            "Histogram of KV cache transfer latency in ms.",
            (1, 2, 5, 10, 25, 50, 100, 250, 500, 1000, 2500, 5000),
        )
        self.kv_transfer_total_mb = histogram(
            "sglang:kv_transfer_total_mb",
            "Histogram of KV cache transfer size in MB.",
            (1, 5, 10, 50, 100, 500, 1000, 5000, 10000),
        )
        self.num_bootstrap_failed_reqs = counter(
            "sglang:num_bootstrap_failed_reqs_total", "The number of bootstrap failed requests."
        )
        self.num_transfer_failed_reqs = counter(
            "sglang:num_transfer_failed_reqs_total", "The number of transfer failed requests."
        )
        self.failed_session_recoveries = counter(
            "sglang:failed_session_recoveries_total", "Blacklisted Mooncake sessions recovered by the probe."
        )
        self.hicache_hit_tokens = counter(
            "tandem_sim:hicache_storage_hit_tokens_total",
            "Simulator only: prompt tokens whose KV a prefill read back from the HiCache L3 store (prefix hits).",
        )
        self.offload_poisoned_pages = counter(
            "tandem_sim:offload_poisoned_pages_total",
            "Simulator only: offloaded pages whose host copy differs from the request's KV (slot reuse race).",
        )
        self.model_name = model_name

    def render(self) -> bytes:
        return generate_latest(self.registry)
