"""The worker container's probes and SGLang's health-check timeout. Pure.

What SGLang 0.5.23 offers (``sglang/srt/entrypoints/http_server.py``: ``health_generate``, ``ready``;
``managers/tokenizer_manager.py``: ``is_healthy``, ``is_ready``; ``managers/scheduler.py``:
``maybe_send_health_check_signal``):

- ``/health_generate`` (and ``/health`` while ``SGLANG_ENABLE_HEALTH_ENDPOINT_GENERATION`` is on, its default)
  sends a one-token request and answers 200 once the scheduler put out anything, 503 after
  ``SGLANG_HEALTH_CHECK_TIMEOUT`` (20 s by default) of silence, and records the verdict (server status ``Up`` or
  ``UnHealthy``). A busy scheduler does not queue the request behind its work: it answers after its next batch (a
  prefill chunk, a decode step). So the check fails only when one batch outlasts the timeout or the scheduler
  stopped.
- ``/ready`` runs nothing: 200 when the server started, is not paused, not exiting, and its last health check
  passed. It is the cheap "process up and scheduler alive" signal: the liveness probe's generation checks (and the
  routers') keep its verdict current.
- Nodes other than a group's first serve only ``launch_dummy_health_check_server`` (``utils/common.py``):
  ``/health``, ``/health_generate`` and ``/ping``, always 200; no ``/ready``.

Budgets. The longest batch the simulator's ``kimi-k2.6-h200`` profile allows is a whole 256K-token prompt in one
forward (``--chunked-prefill-size -1``): 262,144 tokens x 0.153 ms (1000 / 6537, ``tandem_sim/model/profiles.py``) =
**40.1 s** (with the recipe's 16384-token chunks a batch is 2.5 s, the whole prompt the same 40.1 s). The operator
sets ``SGLANG_HEALTH_CHECK_TIMEOUT`` to ``GENERATION_CHECK_TIMEOUT_S`` = 45 s unless a role's env sets it, so a
generation check, whoever sends it, fails only when the scheduler put out nothing for longer than any forward can
take: the scheduler is stuck. Hence:

- readiness: ``/ready`` on the leader (``/health`` on the other nodes): no generation, no flap from long prefills;
  503 while paused or after a failed generation check, which unroutes the group (same epoch, no recreation);
- liveness: ``/health_generate``, timeout = that timeout + 5 s, one failure: a worker whose scheduler put out
  nothing for 45 s is killed 45-56 s after it stopped (the kubelet probes again right after a slow probe, so a
  probe lasts the timeout, not a period). Its probe-level ``terminationGracePeriodSeconds`` (Kubernetes >= 1.25)
  bounds the kill: the preStop hook returns at once for a server whose ``/ready`` fails (``drain_hook.py``) and
  SGLang exits at once on SIGTERM when its last health check failed (``TokenizerManager.sigterm_watchdog``), but a
  server that does neither is SIGKILLed ``PROBE_KILL_GRACE_S`` after the probe failed instead of the pod's
  drain timeout + 30 s;
- startup: ``/health_generate`` within the model-load budget, with the same bounded kill.
"""

from __future__ import annotations

from typing import Any

from tandem.registry import Role
from tandem_operator.api.pdcluster import PDClusterSpec
from tandem_operator.desired.drain_hook import EXIT_GRACE_S

HEALTH_CHECK_TIMEOUT_ENV = "SGLANG_HEALTH_CHECK_TIMEOUT"
LONGEST_FORWARD_S = 262_144 * (1000 / 6537) / 1000  # 40.1 s: a 256K prompt in one forward, kimi-k2.6-h200 profile
GENERATION_CHECK_TIMEOUT_S = 45  # > LONGEST_FORWARD_S, with SGLang's 1 s polling and some slack
STARTUP_PERIOD_S = 10
READINESS_PERIOD_S = 10
READINESS_TIMEOUT_S = 10  # /ready runs nothing: only a stalled HTTP process takes this long
READINESS_FAILURES = 2
LIVENESS_PERIOD_S = 10
LIVENESS_FAILURES = 1  # one failed check is already GENERATION_CHECK_TIMEOUT_S of silence: longer than any batch
PROBE_KILL_GRACE_S = EXIT_GRACE_S  # preStop (returns at once for a failed server) + SGLang's exit after SIGTERM


def health_check_timeout(spec: PDClusterSpec, role: Role) -> int:
    """SGLang's health-check timeout for the role: the user's ``SGLANG_HEALTH_CHECK_TIMEOUT``, else the
    operator's ``GENERATION_CHECK_TIMEOUT_S`` (the pods get it in their env)."""
    value = next((v.value for v in spec.role(role).env if v.name == HEALTH_CHECK_TIMEOUT_ENV), "")
    return int(value) if value.isdigit() and int(value) > 0 else GENERATION_CHECK_TIMEOUT_S


def health_env() -> dict[str, dict[str, Any]]:
    """The operator's default for SGLang's timeout (a role's ``env`` overrides it)."""
    return {HEALTH_CHECK_TIMEOUT_ENV: {"value": str(GENERATION_CHECK_TIMEOUT_S)}}


def _get(path: str) -> dict[str, Any]:
    return {"httpGet": {"path": path, "port": "http"}}


def probes(spec: PDClusterSpec, role: Role, rank: int) -> dict[str, dict[str, Any]]:
    """Startup, readiness and liveness of pod ``rank`` of a group (0: the leader, which serves SGLang's API)."""
    timeout = health_check_timeout(spec, role)
    load_budget = spec.lifecycle.model_load_timeout_seconds

    def generation() -> dict[str, Any]:  # a fresh dict per probe: shared objects would render as YAML anchors
        return {**_get("/health_generate"), "timeoutSeconds": timeout + 5}

    return {
        "startupProbe": {
            **generation(),
            "periodSeconds": STARTUP_PERIOD_S,
            "failureThreshold": -(-load_budget // STARTUP_PERIOD_S),
            "terminationGracePeriodSeconds": PROBE_KILL_GRACE_S,
        },
        "readinessProbe": {
            **_get("/ready" if rank == 0 else "/health"),
            "periodSeconds": READINESS_PERIOD_S,
            "timeoutSeconds": READINESS_TIMEOUT_S,
            "failureThreshold": READINESS_FAILURES,
        },
        "livenessProbe": {
            **generation(),
            "periodSeconds": LIVENESS_PERIOD_S,
            "failureThreshold": LIVENESS_FAILURES,
            "terminationGracePeriodSeconds": PROBE_KILL_GRACE_S,
        },
    }
