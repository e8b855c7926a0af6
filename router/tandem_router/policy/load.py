"""Reading a worker's load from its Prometheus ``/metrics`` text (SGLang's ``sglang:`` gauges)."""

from __future__ import annotations

from dataclasses import dataclass

from prometheus_client.parser import text_string_to_metric_families


@dataclass(frozen=True)
class WorkerLoad:
    running: float = 0.0
    queued: float = 0.0
    kv_usage: float = 0.0  # 0..1


def parse_sglang_metrics(text: str) -> WorkerLoad:
    """Sum the gauges over all label sets (one per attention-DP rank). KV usage is ``sglang:token_usage`` when
    exported, else ``kv_used_tokens / max_total_num_tokens`` when both are; absent gauges read as 0.

    Raises ``ValueError`` on text that is not the Prometheus exposition format.
    """
    sums: dict[str, float] = {}
    counts: dict[str, int] = {}
    for family in text_string_to_metric_families(text):
        if not family.name.startswith("sglang:"):
            continue
        for sample in family.samples:
            sums[sample.name] = sums.get(sample.name, 0.0) + sample.value
            counts[sample.name] = counts.get(sample.name, 0) + 1
    if "sglang:token_usage" in sums:
        usage = sums["sglang:token_usage"] / counts["sglang:token_usage"]
    elif sums.get("sglang:max_total_num_tokens"):
        usage = sums.get("sglang:kv_used_tokens", 0.0) / sums["sglang:max_total_num_tokens"]
    else:
        usage = 0.0
    return WorkerLoad(
        running=sums.get("sglang:num_running_reqs", 0.0),
        queued=sums.get("sglang:num_queue_reqs", 0.0),
        kv_usage=min(max(usage, 0.0), 1.0),
    )
