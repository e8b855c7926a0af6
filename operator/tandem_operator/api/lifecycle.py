"""``PDCluster.spec.lifecycle``: how long a group may load, start and drain.

SGLang's ``/health`` runs a one-token generation (``SGLANG_HEALTH_CHECK_TIMEOUT``, 20 s, in
``sglang/srt/entrypoints/http_server.py``), so a busy worker can look unready for a while; loading a ~600 GB
checkpoint takes many minutes. These budgets keep a loading or busy group alive and bound a stuck one.
"""

from __future__ import annotations

from pydantic import Field

from tandem_operator.api.rules import CrdModel, Rule


class LifecycleSpec(CrdModel):
    """Start-up, stuck-group and drain budgets of every worker group."""

    model_load_timeout_seconds: int = Field(
        default=3600,
        ge=60,
        le=86400,
        description="Model-load budget: the startupProbe allows this long before /health first answers 200 "
        "(liveness and readiness start after it).",
    )
    start_deadline_seconds: int = Field(
        default=5400,
        ge=60,
        le=172800,
        description="A group still Starting or Incomplete (some member not started: unschedulable, pulling, "
        "loading) this long after its newest pod was created is recreated, with an Event.",
    )
    drain_timeout_seconds: int = Field(
        default=600,
        ge=0,
        le=86400,
        description="Scale-down and rollouts unregister a group, then wait up to this long for its running "
        "requests and KV transfers to reach 0 before deleting its pods.",
    )

    cel_rules = (
        Rule(
            cel="self.startDeadlineSeconds > self.modelLoadTimeoutSeconds",
            message="startDeadlineSeconds must exceed modelLoadTimeoutSeconds (a loading group is not stuck)",
            check=lambda s: s.start_deadline_seconds > s.model_load_timeout_seconds,
            field_path=".startDeadlineSeconds",
        ),
    )
