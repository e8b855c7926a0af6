"""``tandem bench autoscale``: one load trace, three ways to size the cluster, SLO attainment against group-seconds.

A model, not a measurement (``tandem_dev.autoscale_model``: the ``kimi-k2.6-h200`` profile as M/D/1 prefill queues
and Poisson decode batches, Poisson arrivals, a retired group gone at once) under each start-time model of
``STARTUPS``: a new group serving a fixed ``STARTUP_S`` after it is asked for (the bench's first model), or after its
modelled weight load (``tandem_dev.scaleout``: the ``kimi-k2.6-h200`` load phases for the role's layout in
``deploy/kimi-k26-h200.yaml``), from a peer when the operator's own seed choice gives it one (a serving group of its
role with fewer than ``maxLoadsPerSeed`` loads in flight that read its weights itself), else from the node's copy.
Every policy reads what it would read in production, every 15 s:

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

from collections.abc import Callable, Mapping, Sequence
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
from tandem_dev.scaleout import Fleet, StartTimes, modelled_times, recipe_spec
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


@dataclass(frozen=True)
class Startup:
    """When a new group serves: per-role times per weight source, and whether the operator loads from peers."""

    name: str
    times: Mapping[Role, StartTimes]
    peer_loading: bool


def startups() -> list[Startup]:
    fixed = StartTimes(STARTUP_S, STARTUP_S)
    peer, node = recipe_spec(True), recipe_spec(False)
    return [
        Startup(f"fixed {STARTUP_S} s", dict.fromkeys(Role, fixed), False),
        Startup("K2.6 load, peer loading", {role: modelled_times(peer, role) for role in Role}, True),
        Startup("K2.6 load, node copy only", {role: modelled_times(node, role) for role in Role}, False),
    ]


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
    startup: str  # ``Startup.name``
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


def simulate(
    name: str, policy: Policy, start: dict[Role, int], interval_s: int, startup: Startup, seed: int = SEED
) -> Run:
    """The trace second by second; arrivals come from their own seeded stream, so every policy gets the same."""
    arrivals, draws = np.random.default_rng([seed, 0]), np.random.default_rng([seed, 1])
    asked = dict(start)
    spec = recipe_spec(startup.peer_loading)
    fleets = {role: Fleet.build(spec, role, startup.times[role], n) for role, n in start.items()}
    run, interval = Run(name, startup.name, []), Interval()
    seen: tuple[float | None, float | None, float | None, float | None] = (None, None, None, None)
    for t in range(TRACE[-1][0]):
        rate = rate_at(t)
        ready = {role: fleets[role].ready(t) for role in Role}
        second = sample_second(draws, conditions(rate, ready[Role.PREFILL], ready[Role.DECODE]), arrivals.poisson(rate))
        if t % interval_s == 0:
            if t:
                seen, interval = run.score(interval), Interval()
            asked = policy(t, View(seen[0], seen[1], second, ready, asked))
            for role in Role:
                fleets[role].resize(t, asked[role])
        interval.add(second)
        run.group_seconds += sum(len(f.groups) for f in fleets.values())
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


def autoscaling_policy(spec: AutoscalingSpec, minimum: Callable[[int], dict[Role, int]] | None = None) -> Policy:
    """The decider; ``minimum``: each role's ``minGroups`` at a second (a schedule patching the spec), else the
    spec's."""
    history = [History()]

    def policy(t: int, view: View) -> dict[Role, int]:
        now = spec
        if minimum is not None:
            low = minimum(t)
            now = spec.model_copy(
                update={
                    "prefill": spec.prefill.model_copy(update={"min_groups": low[Role.PREFILL]}),
                    "decode": spec.decode.model_copy(update={"min_groups": low[Role.DECODE]}),
                }
            )
        decision = decide(now, observation(view), history[0], float(t))
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


def fewest_meeting(rate: float) -> dict[Role, int]:
    """The fewest groups per role whose modelled p90s meet both targets at ``rate`` (within ``BOUNDS``)."""
    for total in range(2, sum(high for _, high in BOUNDS.values()) + 1):
        for prefill in range(1, total):
            decode = total - prefill
            within = prefill <= BOUNDS[Role.PREFILL][1] and decode <= BOUNDS[Role.DECODE][1]
            if within and meets(conditions(rate, prefill, decode)):
                return {Role.PREFILL: prefill, Role.DECODE: decode}
    return {role: high for role, (_, high) in BOUNDS.items()}


def fixed_for_peak() -> dict[Role, int]:
    return fewest_meeting(max(rate for _, rate in TRACE))


def scheduled_minimum(lead_s: float) -> Callable[[int], dict[Role, int]]:
    """``minGroups`` as a schedule written from the trace's known shape (a daily pattern; a CronJob patching the
    PDCluster's autoscaling bounds would apply it): at ``t``, the fewest groups meeting the targets at the highest
    rate of the next ``lead_s`` seconds, so a rise's groups are asked for one start-up ahead of it. The trace is
    known exactly here: the schedule's best case."""

    def minimum(t: int) -> dict[Role, int]:
        return fewest_meeting(max(rate_at(t), rate_at(int(t + lead_s))))

    return minimum


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
SCHEDULED = "autoscaling + scheduled minGroups"
POLICIES = (AUTOSCALING, FIXED, HPA, SCHEDULED)


def lead_s(startup: Startup, interval_s: int) -> float:
    """How far ahead the schedule raises the minimum: the slowest start-up (the node's copy) plus one decision."""
    return max(t.node_s for t in startup.times.values()) + interval_s


def runs(startup: Startup, seed: int = SEED) -> list[Run]:
    """Every policy in ``POLICIES`` order under one start-time model."""
    spec = default_spec()
    if spec.interval_seconds != hpa.SYNC_S:
        raise ValueError("the decider's interval and the HPA's sync period differ: the policies would not compare")
    start, every = {Role.PREFILL: 2, Role.DECODE: 1}, spec.interval_seconds
    scheduled = autoscaling_policy(spec, scheduled_minimum(lead_s(startup, every)))
    return [
        simulate(AUTOSCALING, autoscaling_policy(spec), start, every, startup, seed),
        simulate(FIXED, lambda t, view: view.asked, fixed_for_peak(), every, startup, seed),
        simulate(HPA, hpa_policy(), start, every, startup, seed),
        simulate(SCHEDULED, scheduled, start, every, startup, seed),
    ]


def spread(models: Sequence[Startup], seeds: Sequence[int]) -> Table:
    """The same trace under other seeds: how much of a row is the draw."""
    by_row: dict[tuple[str, str], list[Run]] = {}
    for startup in models:
        for seed in seeds:
            for r in runs(startup, seed):
                by_row.setdefault((r.name, r.startup), []).append(r)
    table = Table(
        f"autoscale: the same trace under {len(seeds)} seeds ({seeds[0]}-{seeds[-1]}): min / median / max",
        ["policy", "group start", "SLO attainment %", "GPU-hours", "p90 misread %"],
    )
    for (name, startup_name), rs in by_row.items():
        columns = (
            [100 * r.met_requests / r.requests for r in rs],
            [r.group_seconds * GPUS_PER_GROUP / 3600 for r in rs],
            [100 * r.misjudged / r.intervals for r in rs],
        )
        table.rows.append([name, startup_name, *(f"{min(c):.1f} / {median(c):.1f} / {max(c):.1f}" for c in columns)])
    return table


def run(args: BenchArgs) -> list[Table]:
    models = startups()
    results = [r for startup in models for r in runs(startup)]
    table = Table(
        "autoscale: SLO attainment and group-seconds on one load trace (model, see tandem_dev/autoscale_bench.py)",
        ["policy", "group start", "SLO attainment %", "group-seconds", "GPU-hours", "max prefill", "max decode",
         "p90 misread %"],
    )  # fmt: skip
    for r in results:
        table.rows.append(
            [
                r.name,
                r.startup,
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
    loads = "; ".join(
        f"{m.name}: " + ", ".join(f"{role.value} node {t.node_s:.1f} s / peer {t.peer_s:.1f} s" for role, t in
                                  m.times.items())
        for m in models[1:]
    )  # fmt: skip
    table.notes += [
        f"trace: {trace} (Poisson arrivals, seed {SEED}); {PROMPT}-token prompts, {OUTPUT}-token outputs; targets "
        f"TTFT p90 {TTFT_TARGET_MS} ms, ITL p90 {ITL_TARGET_MS} ms; {GPUS_PER_GROUP} GPUs/group; decider and HPA "
        f"every {hpa.SYNC_S} s, default windows",
        f"group start: {models[0].name} after being asked for (the bench's former model); {loads} (tandem_sim "
        "weights phases, kimi-k2.6-h200, deploy/kimi-k26-h200.yaml layouts); with peer loading a new group loads from "
        "a peer when the operator's seed_pool + steps give it a seed (spec.peerLoading maxLoadsPerSeed 2; a group "
        "that loaded from a peer never seeds), else from the node's copy",
        f"scheduled minGroups: the decider with each role's minGroups raised to the fewest groups meeting the targets "
        f"at the trace's rate {lead_s(models[0], hpa.SYNC_S):g} s ahead (fixed {STARTUP_S} s) or "
        f"{lead_s(models[2], hpa.SYNC_S):g} s ahead (K2.6 load: the node copy's start-up + one interval); the "
        "schedule knows the trace exactly (its best case)",
        "SLO attainment: share of requests in 15 s intervals whose exact (client-side) TTFT and token-gap p90s meet "
        "the targets; p90 misread: intervals where the router-histogram estimate the decider reads falls on the "
        "other side of a target than the exact p90",
        f"HPA: External AverageValue per group, 10 % tolerance, 300 s scale-down stabilisation; decode target "
        f"{HPA_RUNNING_TARGET:g} = 80 % of the {b_star:.0f}-sequence batch at which a step takes {ITL_TARGET_MS} ms",
    ]
    samples = next(r for r in results if r.name == AUTOSCALING and r.startup == models[1].name).samples
    timeline = Table(
        f"autoscale: the autoscaling run over time, group start {models[1].name} (PNG: load, groups per role, TTFT "
        "and ITL p90 against targets)",
        ["t (s)", "req/s", "prefill groups", "decode groups", "TTFT p90 ms read", "TTFT p90 ms exact",
         "ITL p90 ms read", "ITL p90 ms exact"],
        rows=[[s.t, s.load, s.prefill, s.decode, s.ttft_p90_ms, s.ttft_exact_ms, s.itl_p90_ms, s.itl_exact_ms]
              for s in samples[::300]],
        figure=lambda png: plot_timeline(samples, TTFT_TARGET_MS, ITL_TARGET_MS, png, "requests per second"),
    )  # fmt: skip
    return [table, spread(models, SEEDS[:2] if args.quick else SEEDS), timeline]
