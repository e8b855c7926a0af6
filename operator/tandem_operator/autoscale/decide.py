"""The autoscaler's decision (pure): observed latency and load -> desired groups per role, with the reason.

Prefill and decode saturate differently, so each role is judged by its own signals:

- **prefill** is short of capacity when the routers' TTFT p90 is over target *and* prompts queue on the prefill
  leaders (``sglang:num_queue_reqs`` per group >= ``QUEUED_PER_GROUP``);
- **decode** is short when the ITL p90 is over target, or when the TTFT p90 is over target while prefill queues
  nothing and decode is full (``sglang:token_usage`` >= ``KV_FULL`` or requests queue on decode: SGLang's decode
  admits a transferred request only when it has KV for it, so a full decode delays the first token), or the
  routers hold requests back (their flow-control queues, ``tandem_router_flow_queued_requests``, >=
  ``QUEUED_PER_GROUP`` per decode group): the routers admit what the decodes' learned capacity takes, so demand
  they hold back is demand the decodes cannot run; none of the workers' gauges shows it.

A short role is recommended ``ceil(groups x observed / target)`` groups (at least one more, at most twice as
many, like the HPA's proportional rule). A role may shrink by one group when its latency is below
``scaleDownBelow x target`` (hysteresis: between that and the target nothing moves), it is not queueing (fewer
than ``QUEUED_PER_GROUP`` waiting per group: a request or two waiting for the next batch is normal), the routers
hold no such queue back and, for decode, its KV usage spread over one group fewer stays under ``KV_SHRINK``.

Recommendations are stabilised like the Kubernetes HPA's ``behavior`` (``pkg/controller/podautoscaler``,
``stabilizeRecommendationWithBehaviors``): a scale-up takes the lowest recommendation of the scale-up window, a
scale-down the highest of the scale-down window, so one noisy interval moves nothing. Then the ratio bounds and
min/max are applied. Nothing moves while a role has not settled (ready groups != groups: groups still starting
or draining) nor in the first interval after (its p90 still mixes in the old size), and a metric that could not
be read means hold, never a guess.
"""

from __future__ import annotations

import math
from collections.abc import Mapping
from dataclasses import dataclass, field, replace
from enum import StrEnum

from tandem.registry import Role
from tandem_operator.api.autoscaling import AutoscalingSpec

QUEUED_PER_GROUP = 1.0
KV_FULL = 0.9
KV_SHRINK = 0.6
MAX_GROWTH = 2.0


class Reason(StrEnum):
    SCALE_UP = "ScaleUp"
    SCALE_DOWN = "ScaleDown"
    WITHIN_TARGET = "WithinTarget"
    STABILIZING = "Stabilizing"
    SETTLING = "Settling"
    METRICS_MISSING = "MetricsMissing"
    BOUNDS = "Bounds"
    RATIO = "RatioBound"


@dataclass(frozen=True)
class RoleLoad:
    """One role now: its pool's groups and its leaders' gauges (None: some leader could not be read)."""

    groups: int
    ready_groups: int
    queue_reqs: float | None = None  # summed over the role's leaders
    token_usage: float | None = None  # highest over the role's leaders
    running_reqs: float | None = None
    gen_throughput: float | None = None

    def readable(self) -> bool:
        return None not in (self.queue_reqs, self.token_usage, self.running_reqs, self.gen_throughput)


@dataclass(frozen=True)
class Observation:
    """The routers' p90s over the last interval (0 when no request arrived; None when a router could not be read)
    and both roles' load."""

    ttft_p90_ms: float | None
    itl_p90_ms: float | None
    prefill: RoleLoad
    decode: RoleLoad
    router_queued: Mapping[int, float] = field(default_factory=dict)  # priority -> requests the routers hold back

    def role(self, role: Role) -> RoleLoad:
        return self.prefill if role is Role.PREFILL else self.decode


Records = tuple[tuple[float, int], ...]  # (time in seconds, recommended groups), oldest first


@dataclass(frozen=True)
class History:
    """What the next decision needs from the previous ones: each role's recent recommendations, and the roles
    that were settling (their first interval after settling still mixes the old size in: it is not evidence)."""

    recommendations: Mapping[Role, Records] = field(default_factory=dict)
    settling: frozenset[Role] = frozenset()


@dataclass(frozen=True)
class Verdict:
    current: int
    desired: int
    reason: Reason
    message: str


@dataclass(frozen=True)
class Decision:
    verdicts: Mapping[Role, Verdict]
    history: History


def _grow(groups: int, observed: float, target: float) -> int:
    return min(max(groups + 1, math.ceil(groups * observed / target)), math.ceil(groups * MAX_GROWTH))


def recommend(spec: AutoscalingSpec, obs: Observation, role: Role) -> Verdict:
    """One role's recommendation from this interval alone (before stabilisation, ratio and bounds)."""
    load, targets = obs.role(role), spec.targets
    n = load.groups
    if obs.ttft_p90_ms is None or obs.itl_p90_ms is None:
        return Verdict(n, n, Reason.METRICS_MISSING, "a router's /metrics could not be read: hold")
    if not obs.prefill.readable() or not obs.decode.readable():
        return Verdict(n, n, Reason.METRICS_MISSING, "a group leader's /metrics could not be read: hold")
    if load.ready_groups != n:
        return Verdict(n, n, Reason.SETTLING, f"{load.ready_groups} of {n} groups ready: wait for the last change")
    ttft, itl = obs.ttft_p90_ms, obs.itl_p90_ms
    prefill, decode = obs.prefill, obs.decode
    # readable() above: none of these is None
    prefill_queue, decode_queue, kv = prefill.queue_reqs or 0.0, decode.queue_reqs or 0.0, decode.token_usage or 0.0
    prefill_queued = prefill_queue / max(1, prefill.groups) >= QUEUED_PER_GROUP
    held = sum(obs.router_queued.values())
    held_back = held / max(1, decode.groups) >= QUEUED_PER_GROUP
    decode_full = kv >= KV_FULL or decode_queue / max(1, decode.groups) >= QUEUED_PER_GROUP or held_back
    seen = f"TTFT p90 {ttft:.0f}/{targets.ttft_p90_ms} ms, ITL p90 {itl:.1f}/{targets.itl_p90_ms} ms"
    if held:
        by_priority = ", ".join(f"{n:.0f} at priority {p}" for p, n in sorted(obs.router_queued.items()) if n)
        seen += f", {held:.0f} held back in the routers' queues ({by_priority})"
    if role is Role.PREFILL:
        if ttft > targets.ttft_p90_ms and prefill_queued:
            desired = _grow(n, ttft, targets.ttft_p90_ms)
            return Verdict(n, desired, Reason.SCALE_UP, f"{seen}, {prefill_queue:.0f} prompts queued on prefill")
        if ttft < spec.scale_down_below * targets.ttft_p90_ms and not prefill_queued and not held_back and n > 1:
            return Verdict(n, n - 1, Reason.SCALE_DOWN, f"{seen}, {prefill_queue:.0f} prompts queued on prefill")
        return Verdict(n, n, Reason.WITHIN_TARGET, seen)
    if itl > targets.itl_p90_ms:
        return Verdict(n, _grow(n, itl, targets.itl_p90_ms), Reason.SCALE_UP, f"{seen}: decode is short")
    if ttft > targets.ttft_p90_ms and not prefill_queued and decode_full:
        desired = _grow(n, ttft, targets.ttft_p90_ms)
        note = f"KV usage {kv:.2f}, {decode_queue:.0f} queued on decode"
        return Verdict(n, desired, Reason.SCALE_UP, f"{seen}, prefill idle, {note}")
    quiet = itl < spec.scale_down_below * targets.itl_p90_ms and decode_queue / n < QUEUED_PER_GROUP and not held_back
    if quiet and n > 1 and kv * n / (n - 1) < KV_SHRINK:
        return Verdict(n, n - 1, Reason.SCALE_DOWN, f"{seen}, KV usage {kv:.2f}")
    return Verdict(n, n, Reason.WITHIN_TARGET, seen)


def _stabilize(spec: AutoscalingSpec, verdict: Verdict, past: Records, now: float) -> tuple[Verdict, Records]:
    n = verdict.current
    up_window, down_window = spec.scale_up_stabilization_seconds, spec.scale_down_stabilization_seconds
    # A fresh autoscaler (or one just turned on) starts its windows now, with the current size as their record.
    past = past or ((now, n),)
    kept = tuple((t, r) for t, r in past if now - t < max(up_window, down_window))
    up = min([verdict.desired, *(r for t, r in kept if now - t < up_window)])
    down = max([verdict.desired, *(r for t, r in kept if now - t < down_window)])
    history = (*kept, (now, verdict.desired))
    if verdict.desired > n and up <= n:
        note = f"{verdict.message}; held: a scale-up needs every recommendation of the last {up_window} s"
        return replace(verdict, desired=n, reason=Reason.STABILIZING, message=note), history
    if verdict.desired < n and down >= n:
        note = f"{verdict.message}; held: a scale-down needs every recommendation of the last {down_window} s"
        return replace(verdict, desired=n, reason=Reason.STABILIZING, message=note), history
    desired = up if verdict.desired > n else down if verdict.desired < n else n
    return replace(verdict, desired=desired), history


def _bounded(spec: AutoscalingSpec, verdicts: dict[Role, Verdict]) -> dict[Role, Verdict]:
    """The ratio bounds (raising the lagging role rather than shrinking the other), then min/max."""
    p, d = verdicts[Role.PREFILL].desired, verdicts[Role.DECODE].desired
    bounds = {Role.PREFILL: spec.prefill, Role.DECODE: spec.decode}
    wanted = {Role.PREFILL: p, Role.DECODE: d}
    if spec.ratio is not None:
        low, high = spec.ratio.min, spec.ratio.max
        if p < low * d:
            p = math.ceil(low * d)
            if p > spec.prefill.max_groups:
                p, d = spec.prefill.max_groups, math.floor(spec.prefill.max_groups / low)
        elif p > high * d:
            d = math.ceil(p / high)
            if d > spec.decode.max_groups:
                d, p = spec.decode.max_groups, math.floor(high * spec.decode.max_groups)
    ratioed = {Role.PREFILL: p, Role.DECODE: d}
    out = {}
    for role, verdict in verdicts.items():
        n = min(max(ratioed[role], bounds[role].min_groups), bounds[role].max_groups)
        if n == verdict.desired:
            out[role] = verdict
            continue
        ratio_moved = ratioed[role] != wanted[role]
        reason = Reason.RATIO if ratio_moved and n == ratioed[role] else Reason.BOUNDS
        limits = f"[{bounds[role].min_groups}, {bounds[role].max_groups}]"
        ratio = f"[{spec.ratio.min:g}, {spec.ratio.max:g}]" if spec.ratio is not None else ""
        why = f"prefill:decode ratio within {ratio}" if reason is Reason.RATIO else f"groups within {limits}"
        out[role] = replace(verdict, desired=n, reason=reason, message=f"{verdict.message}; {why}")
    return out


def decide(spec: AutoscalingSpec, obs: Observation, history: History, now: float) -> Decision:
    """Desired groups for both roles. ``history`` is the previous ``Decision.history`` (``History()`` at start)."""
    verdicts: dict[Role, Verdict] = {}
    records: dict[Role, Records] = {}
    settling: set[Role] = set()
    for role in Role:
        raw = recommend(spec, obs, role)
        past = history.recommendations.get(role, ())
        if raw.reason is Reason.SETTLING:
            settling.add(role)
        elif role in history.settling and raw.reason is not Reason.METRICS_MISSING:
            n = raw.current
            raw = Verdict(n, n, Reason.SETTLING, f"{n} groups ready: the next interval measures them alone")
        if raw.reason in (Reason.METRICS_MISSING, Reason.SETTLING):
            verdicts[role], records[role] = raw, past  # a held interval is no evidence either way
        else:
            verdicts[role], records[role] = _stabilize(spec, raw, past, now)
    return Decision(_bounded(spec, verdicts), History(records, frozenset(settling)))
