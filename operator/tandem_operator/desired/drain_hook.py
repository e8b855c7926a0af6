"""The worker gauges that say a group still has work in flight, and the preStop hook that waits for them. Pure.

SGLang 0.5.23's metrics (``sglang/srt/observability/metrics_collector.py``): requests running or queued in the
scheduler, prefill requests waiting for decode's KV indices or with KV in flight to decode, decode requests
waiting for a KV slot or for their KV. A group is drained when their sum on the leader's ``/metrics`` is 0 (the
leader's HTTP server exports every scheduler's gauges; the other ranks serve only a health endpoint).

The hook stops waiting when the leader's ``/ready`` fails: SGLang answers 503 there once a health check found its
scheduler silent for ``SGLANG_HEALTH_CHECK_TIMEOUT`` (``TokenizerManager.is_ready``: status ``UnHealthy``), and
while it is paused, starting or exiting. A hung scheduler has nothing it can drain, though its gauges still count
the stuck requests (the HTTP process serves ``/metrics`` on its own): without this the kubelet's preStop for a
liveness kill waited the whole drain timeout. The liveness probe's own failed check set that status before the
kubelet ran the hook, so the hook returns at its first poll (``desired/probes.py``).
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

# Polls <ready url> and <metrics url> until the server is not ready (503: nothing it can drain), the drain gauges
# sum to 0, or <timeout> seconds pass; an unreachable server has nothing in flight (urllib raises HTTPError, an
# OSError, for the 503). Runs with the image's python3 (no extra tool in the SGLang image).
_PRESTOP = """
import sys, time, urllib.request
ready, url, deadline = sys.argv[1], sys.argv[2], time.time() + float(sys.argv[3])
names = set(sys.argv[4].split(","))
while time.time() < deadline:
    try:
        urllib.request.urlopen(ready, timeout=5).read()
        text = urllib.request.urlopen(url, timeout=5).read().decode()
    except OSError:
        break
    busy = sum(float(l.rsplit(" ", 1)[1]) for l in text.splitlines() if l.split("{")[0].split(" ")[0] in names)
    if busy == 0:
        break
    time.sleep(float(sys.argv[5]))
"""


def prestop_command(leader_url: str, timeout_s: int) -> list[str]:
    """The preStop exec command: wait until the group's leader (``http://host:port``) has nothing in flight, stops
    being ready, or ``timeout_s`` passed."""
    names = ",".join(DRAIN_GAUGES)
    ready, metrics = f"{leader_url}/ready", f"{leader_url}/metrics"
    return ["python3", "-c", _PRESTOP.strip(), ready, metrics, str(timeout_s), names, str(PRESTOP_POLL_S)]
