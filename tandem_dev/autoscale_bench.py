"""``tandem bench autoscale``: one load trace, three ways to size the cluster, SLO attainment against group-seconds.

A model, not a measurement: one second at a time, each role's p90 latency comes from a queueing model of a group
with the simulator's ``kimi-k2.6-h200`` profile (``tandem_sim.profiles``: prefill ``per_token`` x prompt, decode
step ``base + (per_seq + per_kv_token x context) x batch``):

- prefill, an M/D/1 queue per group: service ``s`` = prompt x ``prefill_ms_per_token``, load ``rho = rate x s``,
  mean wait ``W = rho s / (2 (1 - rho))``, TTFT p90 ~ ``s + ln(10) W`` (exponential tail of the wait) + one
  decode step; ``sglang:num_queue_reqs`` ~ ``rho + rho^2 / (2 (1 - rho))``;
- decode, Little's law on the running batch: ``B = rate x output x ITL`` with ``ITL = base + b B``, so
  ``ITL = base / (1 - b rate output)``; ``sglang:token_usage`` = ``B x context / KV_TOKENS``.

A saturated role (load >= 0.98) reads ``SATURATED_MS``. New groups serve ``STARTUP_S`` after they are asked for
(weights from the node-local cache); a retired group stops taking requests at once (the drain).

The three policies on the same trace:

- **autoscaling**: ``tandem_operator.autoscale.decide`` itself, every ``intervalSeconds``, on the modelled
  signals (the defaults a user gets: windows 30 s up and 300 s down, ``scaleDownBelow`` 0.5);
- **fixed for the peak**: the fewest groups per role that meet both targets at the trace's peak rate;
- **HPA on CPU**: one HPA per PDPool with the documented algorithm (``desired = ceil(current x utilisation /
  target)``, 10 % tolerance, 15 s sync, 300 s scale-down stabilisation, scale-up at most +100 % or +4 per 15 s)
  on *modelled* CPU: SGLang 0.5.23's scheduler event loop never sleeps unless ``sleep_on_idle`` is set
  (``managers/scheduler.py``: ``Scheduler.init_idle_sleeper``), so each GPU rank's scheduler holds one core busy
  whatever the load; the tokenizer and detokenizer add ``CPU_S_PER_TOKEN`` per token. Against the K2.6 recipe's
  96-CPU request the utilisation barely moves with load, which is the point: CPU does not see GPU saturation.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Sequence
from dataclasses import dataclass

from tandem.registry import Role
from tandem_dev.autoscale_plot import Sample, plot_timeline
from tandem_dev.bench import BenchArgs, Table
from tandem_operator.api.autoscaling import AutoscalingSpec
from tandem_operator.autoscale.decide import History, Observation, RoleLoad, decide
from tandem_sim.profiles import PROFILES

PROFILE = PROFILES["kimi-k2.6-h200"]
PROMPT, OUTPUT = 4096, 500  # tokens per request
CONTEXT = PROMPT + OUTPUT // 2  # mean context of a running sequence
KV_TOKENS = 500_000  # KV slots per decode group
SATURATED_MS = 60_000.0
STARTUP_S = 120
GPUS_PER_GROUP = 8
RANKS_PER_POD, CPU_REQUEST, CPU_S_PER_TOKEN, CPU_TARGET = 8, 96, 20e-6, 0.7
HPA_SYNC_S, HPA_TOLERANCE, HPA_DOWN_WINDOW_S = 15, 0.1, 300
TTFT_TARGET_MS, ITL_TARGET_MS = 2000, 60
BOUNDS = {Role.PREFILL: (1, 6), Role.DECODE: (1, 4)}
# (until second, requests per second): a rise in steps to the peak, then down: 90 minutes
TRACE = ((900, 1.0), (1800, 2.0), (2700, 3.0), (3600, 1.5), (5400, 0.75))


def rate_at(t: int, trace: Sequence[tuple[int, float]] = TRACE) -> float:
    return next((rate for end, rate in trace if t < end), trace[-1][1])


@dataclass(frozen=True)
class Latency:
    ttft_ms: float
    itl_ms: float
    prefill_queue: float  # per group
    kv_usage: float


def latency(rate: float, prefill: int, decode: int) -> Latency:
    """Both roles' p90 latency and gauges at ``rate`` requests per second spread over the groups."""
    s = PROFILE.prefill_s(PROMPT)
    rho = rate / max(prefill, 1) * s
    b = PROFILE.decode_ms_per_seq + PROFILE.decode_ms_per_kv_token * CONTEXT
    load_d = b / 1000 * rate / max(decode, 1) * OUTPUT
    itl = SATURATED_MS if load_d >= 0.98 or decode == 0 else PROFILE.decode_base_ms / (1 - load_d)
    if rho >= 0.98 or prefill == 0:
        return Latency(SATURATED_MS, itl, 50.0, min(1.0, load_d))
    wait = rho * s / (2 * (1 - rho))
    ttft = (s + math.log(10) * wait) * 1000 + itl
    batch = rate / max(decode, 1) * OUTPUT * itl / 1000
    return Latency(ttft, itl, rho + rho * rho / (2 * (1 - rho)), min(1.0, batch * CONTEXT / KV_TOKENS))


def meets(lat: Latency) -> bool:
    return lat.ttft_ms <= TTFT_TARGET_MS and lat.itl_ms <= ITL_TARGET_MS


@dataclass
class Run:
    name: str
    samples: list[Sample]
    met_requests: float = 0.0
    requests: float = 0.0
    group_seconds: float = 0.0


# A policy sees (second, latency now, ready groups, asked groups) and returns the groups it asks for.
Policy = Callable[[int, Latency, dict[Role, int], dict[Role, int]], dict[Role, int]]


def simulate(name: str, policy: Policy, start: dict[Role, int]) -> Run:
    asked = dict(start)
    ready_at: dict[Role, list[int]] = {role: [0] * n for role, n in start.items()}  # when each group serves
    run = Run(name, [])
    for t in range(TRACE[-1][0]):
        rate = rate_at(t)
        ready = {role: sum(1 for at in ready_at[role] if at <= t) for role in Role}
        lat = latency(rate, ready[Role.PREFILL], ready[Role.DECODE])
        run.requests += rate
        run.met_requests += rate if meets(lat) else 0.0
        run.group_seconds += sum(len(v) for v in ready_at.values())
        run.samples.append(Sample(t, rate, asked[Role.PREFILL], asked[Role.DECODE], lat.ttft_ms, lat.itl_ms))
        asked = policy(t, lat, ready, asked)
        for role in Role:
            while len(ready_at[role]) < asked[role]:
                ready_at[role].append(t + STARTUP_S)
            del ready_at[role][asked[role] :]  # the newest go first
    return run


def autoscaling_policy(spec: AutoscalingSpec) -> Policy:
    history = [History()]

    def policy(t: int, lat: Latency, ready: dict[Role, int], asked: dict[Role, int]) -> dict[Role, int]:
        if t % spec.interval_seconds:
            return asked
        gauges = {
            Role.PREFILL: RoleLoad(asked[Role.PREFILL], ready[Role.PREFILL], lat.prefill_queue * ready[Role.PREFILL],
                                   0.1, 1.0, 1.0),
            Role.DECODE: RoleLoad(asked[Role.DECODE], ready[Role.DECODE], 0.0, lat.kv_usage, 1.0, 1.0),
        }  # fmt: skip
        obs = Observation(lat.ttft_ms, lat.itl_ms, gauges[Role.PREFILL], gauges[Role.DECODE])
        decision = decide(spec, obs, history[0], float(t))
        history[0] = decision.history
        return {role: v.desired for role, v in decision.verdicts.items()}

    return policy


def hpa_policy() -> Policy:
    """One HPA per pool, its documented algorithm on modelled CPU (see the module docstring)."""
    recommendations: dict[Role, list[tuple[int, int]]] = {role: [] for role in Role}

    def policy(t: int, lat: Latency, ready: dict[Role, int], asked: dict[Role, int]) -> dict[Role, int]:
        del lat
        if t % HPA_SYNC_S:
            return asked
        out = dict(asked)
        tokens = {Role.PREFILL: rate_at(t) * PROMPT, Role.DECODE: rate_at(t) * OUTPUT}
        for role in Role:
            n, (low, high) = asked[role], BOUNDS[role]
            utilisation = (RANKS_PER_POD + tokens[role] / max(ready[role], 1) * CPU_S_PER_TOKEN) / CPU_REQUEST
            ratio = utilisation / CPU_TARGET
            wanted = n if abs(ratio - 1) <= HPA_TOLERANCE else math.ceil(n * ratio)
            wanted = min(max(wanted, low), high, n + max(n, 4))
            recent = [(at, r) for at, r in recommendations[role] if t - at < HPA_DOWN_WINDOW_S] + [(t, wanted)]
            recommendations[role] = recent
            out[role] = wanted if wanted >= n else max(r for _, r in recent)
        return out

    return policy


def fixed_for_peak() -> dict[Role, int]:
    peak = max(rate for _, rate in TRACE)
    for total in range(2, sum(high for _, high in BOUNDS.values()) + 1):
        for prefill in range(1, total):
            if meets(latency(peak, prefill, total - prefill)):
                return {Role.PREFILL: prefill, Role.DECODE: total - prefill}
    return {role: high for role, (_, high) in BOUNDS.items()}


def default_spec() -> AutoscalingSpec:
    return AutoscalingSpec.model_validate(
        {
            "targets": {"ttftP90Ms": TTFT_TARGET_MS, "itlP90Ms": ITL_TARGET_MS},
            "prefill": {"minGroups": BOUNDS[Role.PREFILL][0], "maxGroups": BOUNDS[Role.PREFILL][1]},
            "decode": {"minGroups": BOUNDS[Role.DECODE][0], "maxGroups": BOUNDS[Role.DECODE][1]},
            "routerMetrics": ["http://modelled/metrics"],
        }
    )


def runs() -> list[Run]:
    start = {Role.PREFILL: 2, Role.DECODE: 1}
    return [
        simulate("autoscaling (tandem)", autoscaling_policy(default_spec()), start),
        simulate("fixed for the peak", lambda t, lat, ready, asked: asked, fixed_for_peak()),
        simulate("HPA on CPU (modelled)", hpa_policy(), start),
    ]


def run(args: BenchArgs) -> list[Table]:
    del args  # the model takes milliseconds: quick and full runs are the same
    results = runs()
    table = Table(
        "autoscale: SLO attainment and group-seconds on one load trace (model, see tandem_dev/autoscale_bench.py)",
        ["policy", "SLO attainment %", "group-seconds", "GPU-hours", "max prefill", "max decode"],
    )
    for r in results:
        table.rows.append(
            [
                r.name,
                100 * r.met_requests / r.requests,
                r.group_seconds,
                r.group_seconds * GPUS_PER_GROUP / 3600,
                max(s.prefill for s in r.samples),
                max(s.decode for s in r.samples),
            ]
        )
    trace = ", ".join(f"{rate:g} req/s until {end} s" for end, rate in TRACE)
    table.notes += [
        f"trace: {trace}; {PROMPT}-token prompts, {OUTPUT}-token outputs; targets TTFT p90 {TTFT_TARGET_MS} ms, ITL "
        f"p90 {ITL_TARGET_MS} ms; new groups serve {STARTUP_S} s after being asked for; {GPUS_PER_GROUP} GPUs/group",
        "SLO attainment: share of requests arriving while both modelled p90s meet their targets",
        "HPA: the documented algorithm on modelled CPU (SGLang's scheduler loop spins one core per GPU rank)",
    ]
    samples = results[0].samples
    timeline = Table(
        "autoscale: the autoscaling run over time (PNG: load, groups per role, TTFT and ITL p90 against targets)",
        ["t (s)", "req/s", "prefill groups", "decode groups", "TTFT p90 ms", "ITL p90 ms"],
        rows=[[s.t, s.load, s.prefill, s.decode, s.ttft_p90_ms, s.itl_p90_ms] for s in samples[::300]],
        figure=lambda png: plot_timeline(samples, TTFT_TARGET_MS, ITL_TARGET_MS, png, "requests per second"),
    )
    return [table, timeline]
