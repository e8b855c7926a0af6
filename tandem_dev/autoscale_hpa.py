"""The autoscale bench's baseline (pure): one Kubernetes HPA per PDPool on an SGLang gauge, as a platform team would
set it up without Tandem's decider.

The signals are the ones GKE's guide to autoscaling LLM inference names for server metrics (queue size for
throughput, batch size for latency; "Best practices for autoscaling LLM inference workloads with GPUs"): prefill on
``sglang:num_queue_reqs``, decode on ``sglang:num_running_reqs``, each summed over the pool's group leaders (only a
leader serves ``/metrics``) and divided by the pool's groups: an ``External`` metric with an ``AverageValue``
target, the form a Prometheus adapter or a KEDA ``prometheus`` trigger gives. The algorithm is the HPA
controller's (``pkg/controller/podautoscaler``):

- ``GetExternalPerPodMetricReplicas``: ``ratio = sum / (target x status.replicas)``; outside the 10 % tolerance the
  recommendation is ``ceil(sum / target)``. ``status.replicas`` counts groups still starting, which report nothing;
- ``stabilizeRecommendationWithBehaviors`` with the default ``behavior``: no scale-up window, a scale-down takes
  the highest recommendation of the last 300 s;
- ``convertDesiredReplicasWithBehaviorRate``: scale-up at most ``max(+100 %, +4)`` per 15 s period, then
  ``minReplicas`` / ``maxReplicas``. The controller syncs every 15 s (``--horizontal-pod-autoscaler-sync-period``).
"""

from __future__ import annotations

import math
from dataclasses import dataclass

SYNC_S = 15
TOLERANCE = 0.1
DOWN_WINDOW_S = 300

Records = tuple[tuple[int, int], ...]  # (second, recommendation), oldest first


@dataclass(frozen=True)
class Hpa:
    metric: str
    target: float  # AverageValue per group
    min_replicas: int
    max_replicas: int


def recommend(hpa: Hpa, current: int, total: float) -> int:
    """The replica calculator for an external metric with an ``AverageValue`` target."""
    if current <= 0 or abs(total / (hpa.target * current) - 1) <= TOLERANCE:
        return current
    return math.ceil(total / hpa.target)


def step(hpa: Hpa, records: Records, now: int, current: int, total: float) -> tuple[int, Records]:
    """One sync: the recommendation, stabilised, rate-limited and bounded; and the records the next sync needs."""
    desired = recommend(hpa, current, total)
    kept = (*((at, r) for at, r in records if now - at < DOWN_WINDOW_S), (now, desired))
    down = max(r for _, r in kept)  # the scale-up window is 0 s: the up recommendation is ``desired`` itself
    stabilised = max(current, desired) if desired >= current else min(current, down)
    limited = min(stabilised, max(current + 4, 2 * current))
    return min(max(limited, hpa.min_replicas), hpa.max_replicas), kept
