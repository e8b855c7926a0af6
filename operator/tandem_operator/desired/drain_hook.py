"""The worker gauges that say a group still has work in flight, and the preStop hook that waits for them. Pure.

SGLang 0.5.23's metrics (``sglang/srt/observability/metrics_collector.py``): requests running or queued in the
scheduler, prefill requests waiting for decode's KV indices or with KV in flight to decode, decode requests
waiting for a KV slot or for their KV. A group is drained when their sum on the leader's ``/metrics`` is 0 (the
leader's HTTP server exports every scheduler's gauges; the other ranks serve only a health endpoint).
"""

from __future__ import annotations

DRAIN_GAUGES = (
    "sglang:num_running_reqs",
    "sglang:num_queue_reqs",
    "sglang:num_prefill_bootstrap_queue_reqs",
    "sglang:num_prefill_inflight_queue_reqs",
    "sglang:num_decode_prealloc_queue_reqs",
    "sglang:num_decode_transfer_queue_reqs",
)
PRESTOP_POLL_S = 2
# Time after the preStop hook for SGLang to exit on SIGTERM before the kubelet kills it.
EXIT_GRACE_S = 30

# Polls <url> until the drain gauges sum to 0 or <timeout> seconds pass; an unreachable server has nothing in
# flight. Runs with the image's python3 (no extra tool in the SGLang image).
_PRESTOP = """
import sys, time, urllib.request
url, deadline, names = sys.argv[1], time.time() + float(sys.argv[2]), set(sys.argv[3].split(","))
while time.time() < deadline:
    try:
        text = urllib.request.urlopen(url, timeout=5).read().decode()
    except OSError:
        break
    busy = sum(float(l.rsplit(" ", 1)[1]) for l in text.splitlines() if l.split("{")[0].split(" ")[0] in names)
    if busy == 0:
        break
    time.sleep(float(sys.argv[4]))
"""


def prestop_command(metrics_url: str, timeout_s: int) -> list[str]:
    """The preStop exec command: wait until the group's leader has nothing in flight (or ``timeout_s``)."""
    names = ",".join(DRAIN_GAUGES)
    return ["python3", "-c", _PRESTOP.strip(), metrics_url, str(timeout_s), names, str(PRESTOP_POLL_S)]
