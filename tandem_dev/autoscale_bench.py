"""``tandem bench autoscale``: one load trace, three ways to size the cluster, SLO attainment against group-seconds.

A model, not a measurement (``tandem_dev.autoscale_model``: the ``kimi-k2.6-h200`` profile as M/D/1 prefill queues
and Poisson decode batches, Poisson arrivals, groups serving ``STARTUP_S`` after they are asked for, a retired group
gone at once). Every policy reads what it would read in production, every 15 s:

- **autoscaling**: ``tandem_operator.autoscale.decide`` itself, with the defaults a user gets (interval 15 s,
  windows 30 s up and 300 s down, ``scaleDownBelow`` 0.5), fed the p90s the operator would compute: the interval's
  sampled TTFTs and token gaps binned into the routers' real bucket bounds and interpolated as Prometheus's
  ``histogram_quantile`` does (``tandem_dev.autoscale_histogram``), and the leaders' gauges drawn at the scrape;
- **fixed for the peak**: the fewest groups per role whose modelled p90s meet both targets at the peak rate;
- **HPA on SGLang gauges**: one HPA per PDPool (``tandem_dev.autoscale_hpa``: the controller's algorithm and
  default behaviour), prefill on ``sglang:num_queue_reqs`` with ``HPA_QUEUE_TARGET`` waiting prompts per group,
  decode on ``sglang:num_running_reqs`` with ``HPA_RUNNING_TARGET`` sequences per group. Both targets are what a
  platform team would read off a load test of this model at the SLO (see the constants), the HPA's best case.

Scoring is client-side on the same sampled requests: each 15 s interval's requests count as meeting the SLO when
that interval's *exact* TTFT p90 and token-gap p90 (no buckets) meet the targets. The histogram's own error shows
as the share of intervals where the estimate and the exact p90 fall on different sides of a target.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from statistics import median

import numpy as np

from tandem.registry import Role
from tandem_dev import autoscale_hpa as hpa
from tandem_dev.autoscale_histogram import ITL_BOUNDS, TTFT_BOUNDS, estimate_p90_ms, exact_p90_ms
from tandem_dev.autoscale_model import (
    OUTPUT,
    PER_SEQ_MS,
    PROFILE,
    PROMPT,
    Conditions,
    Second,
    conditions,
    model_p90_ms,
    sample_second,
)
from tandem_dev.autoscale_plot import Sample, plot_timeline
from tandem_dev.bench import BenchArgs, Table
from tandem_operator.api.autoscaling import AutoscalingSpec
from tandem_operator.autoscale.decide import History, Observation, RoleLoad, decide

SEED = 41  # the table's and the timeline's run; ``SEEDS`` for the spread
SEEDS = tuple(range(41, 51))
STARTUP_S = 120
GPUS_PER_GROUP = 8
TTFT_TARGET_MS, ITL_TARGET_MS = 2000, 60
BOUNDS = {Role.PREFILL: (1, 6), Role.DECODE: (1, 4)}
# (until second, requests per second): a rise in steps to the peak, then down: 90 minutes
TRACE = ((900, 1.0), (1800, 2.0), (2700, 3.0), (3600, 1.5), (5400, 0.75))
# The HPA's targets, read off the model at the SLO: a prefill group's TTFT p90 reaches 2 s at rho ~0.59, where
# rho^2 / (2 (1 - rho)) ~0.42 prompts wait on average, so 0.5 ("500m"); a decode step reaches 60 ms at a batch of
# (60 - 20) / 0.447 ~ 89 sequences, and 80 % of it leaves headroom for the batch's spread.
HPA_QUEUE_TARGET = 0.5
HPA_RUNNING_TARGET = 72.0


def rate_at(t: int, trace: Sequence[tuple[int, float]] = TRACE) -> float:
    return next((rate for end, rate in trace if t < end), trace[-1][1])


@dataclass(frozen=True)
class View:
    """What an autoscaler reads at a tick: the routers' p90 estimates over the last interval (None before the first
    one), this second's gauges, and the pools' groups."""

    ttft_p90_ms: float | None
    itl_p90_ms: float | None
    gauges: Second
    ready: dict[Role, int]
    asked: dict[Role, int]


# A policy sees (second, what it reads) and returns the groups it asks for.
Policy = Callable[[int, View], dict[Role, int]]


@dataclass
class Interval:
    """One interval's sampled requests and token gaps."""

    ttft: list[tuple[float, float]] = field(default_factory=list)
    gaps: list[tuple[float, float]] = field(default_factory=list)

    def add(self, second: Second) -> None:
        self.ttft += [(v, 1.0) for v in second.ttft_s]
        self.gaps += second.gaps


@dataclass
class Run:
    name: str
    samples: list[Sample]
    met_requests: float = 0.0
    requests: float = 0.0
    group_seconds: float = 0.0
    intervals: int = 0
    misjudged: int = 0  # intervals whose estimate and exact p90 fall on different sides of a target

    def score(self, interval: Interval) -> tuple[float, float, float | None, float | None]:
        """The interval's estimates (what the operator reads) and exact p90s (what its clients see)."""
        est = estimate_p90_ms(interval.ttft, TTFT_BOUNDS), estimate_p90_ms(interval.gaps, ITL_BOUNDS)
        exact = exact_p90_ms(interval.ttft), exact_p90_ms(interval.gaps)
        self.requests += len(interval.ttft)
        met = [e is None or e <= target for e, target in zip(exact, (TTFT_TARGET_MS, ITL_TARGET_MS), strict=True)]
        self.met_requests += len(interval.ttft) if all(met) else 0
        self.intervals += 1
        seen = [e <= target for e, target in zip(est, (TTFT_TARGET_MS, ITL_TARGET_MS), strict=True)]
        self.misjudged += seen != met
        return est[0], est[1], exact[0], exact[1]


def simulate(name: str, policy: Policy, start: dict[Role, int], interval_s: int, seed: int = SEED) -> Run:
    """The trace second by second; arrivals come from their own seeded stream, so every policy gets the same."""
    arrivals, draws = np.random.default_rng([seed, 0]), np.random.default_rng([seed, 1])
    asked = dict(start)
    ready_at: dict[Role, list[int]] = {role: [0] * n for role, n in start.items()}  # when each group serves
    run, interval = Run(name, []), Interval()
    seen: tuple[float | None, float | None, float | None, float | None] = (None, None, None, None)
    for t in range(TRACE[-1][0]):
        rate = rate_at(t)
        ready = {role: sum(1 for at in ready_at[role] if at <= t) for role in Role}
        second = sample_second(draws, conditions(rate, ready[Role.PREFILL], ready[Role.DECODE]), arrivals.poisson(rate))
        if t % interval_s == 0:
            if t:
                seen, interval = run.score(interval), Interval()
            asked = policy(t, View(seen[0], seen[1], second, ready, asked))
            for role in Role:
                while len(ready_at[role]) < asked[role]:
                    ready_at[role].append(t + STARTUP_S)
                del ready_at[role][asked[role] :]  # the newest go first
        interval.add(second)
        run.group_seconds += sum(len(v) for v in ready_at.values())
        run.samples.append(Sample(t, rate, asked[Role.PREFILL], asked[Role.DECODE], *seen))
    run.score(interval)
    return run


def observation(view: View) -> Observation:
    g = view.gauges
    prefill_running = float(sum(1 for n in g.prefill_in_system if n))
    loads = {
        Role.PREFILL: RoleLoad(view.asked[Role.PREFILL], view.ready[Role.PREFILL], g.prefill_waiting, 0.0,
                               prefill_running, 0.0),
        Role.DECODE: RoleLoad(view.asked[Role.DECODE], view.ready[Role.DECODE], g.decode_waiting, g.token_usage,
                              float(sum(g.decode_running)), g.gen_throughput),
    }  # fmt: skip
    return Observation(view.ttft_p90_ms, view.itl_p90_ms, loads[Role.PREFILL], loads[Role.DECODE])


def autoscaling_policy(spec: AutoscalingSpec) -> Policy:
    history = [History()]

    def policy(t: int, view: View) -> dict[Role, int]:
        decision = decide(spec, observation(view), history[0], float(t))
        history[0] = decision.history
        return {role: v.desired for role, v in decision.verdicts.items()}

    return policy


def hpas() -> dict[Role, hpa.Hpa]:
    (p_min, p_max), (d_min, d_max) = BOUNDS[Role.PREFILL], BOUNDS[Role.DECODE]
    return {
        Role.PREFILL: hpa.Hpa("sglang:num_queue_reqs", HPA_QUEUE_TARGET, p_min, p_max),
        Role.DECODE: hpa.Hpa("sglang:num_running_reqs", HPA_RUNNING_TARGET, d_min, d_max),
    }


def hpa_policy() -> Policy:
    """One HPA per pool on the leaders' gauges (see ``tandem_dev.autoscale_hpa``)."""
    per_role, records = hpas(), {role: hpa.Records() for role in Role}

    def policy(t: int, view: View) -> dict[Role, int]:
        totals = {Role.PREFILL: view.gauges.prefill_waiting, Role.DECODE: float(sum(view.gauges.decode_running))}
        out = {}
        for role in Role:
            out[role], records[role] = hpa.step(per_role[role], records[role], t, view.asked[role], totals[role])
        return out

    return policy


def meets(c: Conditions) -> bool:
    ttft, itl = model_p90_ms(c)
    return ttft <= TTFT_TARGET_MS and itl <= ITL_TARGET_MS


def fixed_for_peak() -> dict[Role, int]:
    peak = max(rate for _, rate in TRACE)
    for total in range(2, sum(high for _, high in BOUNDS.values()) + 1):
        for prefill in range(1, total):
            if meets(conditions(peak, prefill, total - prefill)):
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


AUTOSCALING, FIXED = "autoscaling (tandem)", "fixed for the peak"
HPA = f"HPA: prefill queue {HPA_QUEUE_TARGET:g}/group, decode running {HPA_RUNNING_TARGET:g}/group"


def runs(seed: int = SEED) -> list[Run]:
    spec = default_spec()
    if spec.interval_seconds != hpa.SYNC_S:
        raise ValueError("the decider's interval and the HPA's sync period differ: the policies would not compare")
    start, every = {Role.PREFILL: 2, Role.DECODE: 1}, spec.interval_seconds
    return [
        simulate(AUTOSCALING, autoscaling_policy(spec), start, every, seed),
        simulate(FIXED, lambda t, view: view.asked, fixed_for_peak(), every, seed),
        simulate(HPA, hpa_policy(), start, every, seed),
    ]


def spread(seeds: Sequence[int]) -> Table:
    """The same trace under other seeds: how much of a row is the draw."""
    by_policy: dict[str, list[Run]] = {}
    for seed in seeds:
        for r in runs(seed):
            by_policy.setdefault(r.name, []).append(r)
    table = Table(
        f"autoscale: the same trace under {len(seeds)} seeds ({seeds[0]}-{seeds[-1]}): min / median / max",
        ["policy", "SLO attainment %", "GPU-hours", "p90 misread %"],
    )
    for name, rs in by_policy.items():
        columns = (
            [100 * r.met_requests / r.requests for r in rs],
            [r.group_seconds * GPUS_PER_GROUP / 3600 for r in rs],
            [100 * r.misjudged / r.intervals for r in rs],
        )
        table.rows.append([name, *(f"{min(c):.1f} / {median(c):.1f} / {max(c):.1f}" for c in columns)])
    return table


def run(args: BenchArgs) -> list[Table]:
    results = runs()
    table = Table(
        "autoscale: SLO attainment and group-seconds on one load trace (model, see tandem_dev/autoscale_bench.py)",
        ["policy", "SLO attainment %", "group-seconds", "GPU-hours", "max prefill", "max decode", "p90 misread %"],
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
                100 * r.misjudged / r.intervals,
            ]
        )
    trace = ", ".join(f"{rate:g} req/s until {end} s" for end, rate in TRACE)
    b_star = (ITL_TARGET_MS - PROFILE.decode_base_ms) / PER_SEQ_MS
    table.notes += [
        f"trace: {trace} (Poisson arrivals, seed {SEED}); {PROMPT}-token prompts, {OUTPUT}-token outputs; targets "
        f"TTFT p90 {TTFT_TARGET_MS} ms, ITL p90 {ITL_TARGET_MS} ms; new groups serve {STARTUP_S} s after being "
        f"asked for; {GPUS_PER_GROUP} GPUs/group; decider and HPA every {hpa.SYNC_S} s, default windows",
        "SLO attainment: share of requests in 15 s intervals whose exact (client-side) TTFT and token-gap p90s meet "
        "the targets; p90 misread: intervals where the router-histogram estimate the decider reads falls on the "
        "other side of a target than the exact p90",
        f"HPA: External AverageValue per group, 10 % tolerance, 300 s scale-down stabilisation; decode target "
        f"{HPA_RUNNING_TARGET:g} = 80 % of the {b_star:.0f}-sequence batch at which a step takes {ITL_TARGET_MS} ms",
    ]
    samples = results[0].samples
    timeline = Table(
        "autoscale: the autoscaling run over time (PNG: load, groups per role, TTFT and ITL p90 against targets)",
        ["t (s)", "req/s", "prefill groups", "decode groups", "TTFT p90 ms read", "TTFT p90 ms exact",
         "ITL p90 ms read", "ITL p90 ms exact"],
        rows=[[s.t, s.load, s.prefill, s.decode, s.ttft_p90_ms, s.ttft_exact_ms, s.itl_p90_ms, s.itl_exact_ms]
              for s in samples[::300]],
        figure=lambda png: plot_timeline(samples, TTFT_TARGET_MS, ITL_TARGET_MS, png, "requests per second"),
    )  # fmt: skip
    return [table, spread(SEEDS[:3] if args.quick else SEEDS), timeline]
