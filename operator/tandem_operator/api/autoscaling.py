"""``PDCluster.spec.autoscaling`` and ``status.autoscaling``: scale prefill and decode to TTFT and ITL targets.

When ``spec.autoscaling`` is set the operator owns ``PDPool.spec.replicas`` of both roles: every
``intervalSeconds`` it reads the routers' and the group leaders' ``/metrics``, decides with
``tandem_operator.autoscale.decide`` and writes the pools' replicas through the scale subresource (a ``kubectl
scale`` is then only a new starting point, clamped to min/max, that later decisions move). Without it, replicas are
the user's (``kubectl scale``, an HPA). Scale-down goes through the drain like any other scale-down.
"""

from __future__ import annotations

from pydantic import Field
from pydantic.alias_generators import to_camel

from tandem_operator.api.common import LabelValue, Port
from tandem_operator.api.rules import CrdModel, Rule


def _ordered(low: str, high: str) -> Rule:
    """``low <= high`` (Python field names), reported on ``low``."""
    wire_low, wire_high = to_camel(low), to_camel(high)
    return Rule(
        cel=f"self.{wire_low} <= self.{wire_high}",
        message=f"{wire_low} must be less than or equal to {wire_high}",
        check=lambda s: bool(getattr(s, low) <= getattr(s, high)),
        field_path=f".{wire_low}",
    )


class SloTargets(CrdModel):
    """Latency targets, as the routers measure them (time to first byte relayed, time between relayed chunks)."""

    ttft_p90_ms: int = Field(ge=1, le=600000, description="90th percentile of the time to first token, ms.")
    itl_p90_ms: int = Field(ge=1, le=60000, description="90th percentile of the inter-token latency, ms.")


class RoleBounds(CrdModel):
    """How many groups the autoscaler may give one role."""

    min_groups: int = Field(default=1, ge=1, le=1000, description="Never fewer groups than this.")
    max_groups: int = Field(default=4, ge=1, le=1000, description="Never more groups than this.")

    cel_rules = (_ordered("min_groups", "max_groups"),)


class GroupRatio(CrdModel):
    """Bounds on prefill groups per decode group (e.g. 0.25-2): both roles stay in proportion while scaling."""

    min: float = Field(default=0.0, ge=0, le=1000, description="Lowest prefill:decode group ratio.")
    max: float = Field(default=1000.0, gt=0, le=1000, description="Highest prefill:decode group ratio.")

    cel_rules = (_ordered("min", "max"),)


class AutoscalingSpec(CrdModel):
    """SLO-driven autoscaling of both roles (``tandem_operator.autoscale``)."""

    targets: SloTargets
    prefill: RoleBounds = Field(default_factory=RoleBounds)
    decode: RoleBounds = Field(default_factory=RoleBounds)
    ratio: GroupRatio | None = Field(default=None, description="Optional prefill:decode group ratio bounds.")
    router_metrics: list[str] = Field(
        default_factory=list,
        max_length=64,
        description="Each router replica's /metrics URL (http://<host>:<port>/metrics), for routers that are not "
        "pods of this namespace; else use routerSelector. Every replica must be listed: a Service URL would read "
        "a different replica at each scrape.",
    )
    router_selector: dict[str, LabelValue] = Field(
        default_factory=dict,
        max_length=16,
        description="Labels of the router pods in the PDCluster's namespace (the chart's: app.kubernetes.io/"
        "instance: <release>, app.kubernetes.io/component: router): every Ready one is read at "
        "http://<pod IP>:<routerPort>/metrics.",
    )
    router_port: Port = Field(default=8000, description="The routers' HTTP port (with routerSelector).")
    interval_seconds: int = Field(default=15, ge=1, le=600, description="Seconds between two decisions.")
    scale_up_stabilization_seconds: int = Field(
        default=30,
        ge=0,
        le=3600,
        description="A scale-up needs every recommendation of this window to want it (the lowest wins).",
    )
    scale_down_stabilization_seconds: int = Field(
        default=300,
        ge=0,
        le=86400,
        description="A scale-down needs every recommendation of this window to want it (the highest wins).",
    )
    scale_down_below: float = Field(
        default=0.5,
        gt=0,
        lt=1,
        description="Hysteresis: a role may shrink only while its latency p90 is below this fraction of the "
        "target (and it queues less than one request per group).",
    )

    cel_rules = (
        Rule(
            cel="(has(self.routerMetrics) && size(self.routerMetrics) > 0) != "
            "(has(self.routerSelector) && size(self.routerSelector) > 0)",
            message="set exactly one of routerMetrics and routerSelector (where the routers' /metrics are)",
            check=lambda s: bool(s.router_metrics) != bool(s.router_selector),
            field_path=".routerMetrics",
        ),
        Rule(
            cel="!has(self.ratio) || self.ratio.max * double(self.decode.maxGroups) >= double(self.prefill.minGroups)"
            " && self.ratio.min * double(self.decode.minGroups) <= double(self.prefill.maxGroups)",
            message="ratio cannot be met within the min and max groups of prefill and decode",
            check=lambda s: (
                s.ratio is None
                or (
                    s.ratio.max * s.decode.max_groups >= s.prefill.min_groups
                    and s.ratio.min * s.decode.min_groups <= s.prefill.max_groups
                )
            ),
            field_path=".ratio",
        ),
    )


class RoleDecision(CrdModel):
    """The last decision for one role."""

    current_groups: int = Field(default=0, ge=0)
    desired_groups: int = Field(default=0, ge=0)
    reason: str = Field(default="", max_length=64, description="ScaleUp, ScaleDown, Hold, MetricsMissing, ...")
    message: str = Field(default="", max_length=1024, description="Why, with the numbers it saw.")


class AutoscalingStatus(CrdModel):
    """What the autoscaler saw and decided last (written every interval while autoscaling is on)."""

    last_decision_time: str = Field(default="", description="RFC 3339 time of the last decision.")
    ttft_p90_ms: float | None = Field(default=None, ge=0, description="Routers' TTFT p90 over the last interval.")
    itl_p90_ms: float | None = Field(default=None, ge=0, description="Routers' ITL p90 over the last interval.")
    prefill: RoleDecision = Field(default_factory=RoleDecision)
    decode: RoleDecision = Field(default_factory=RoleDecision)
