"""The tables of ``tandem bench prefix``: every run (one policy, one workload, one seed) and per policy the median
over seeds with the min-max.

Why per seed, then summarised (issue #41 item 6): one run of each policy is one draw of the workload's randomness
and of the shared machine's load; a ratio to ``smg`` is only fair within a seed (same conversations, measured
minutes apart in one round), so "p99 vs smg" is computed per seed and only then summarised, never as a ratio of
medians.
"""

from __future__ import annotations

import statistics
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field

from tandem_dev.bench import NOT_MEASURED, Plot, Table

PERCENTILES = (0, 10, 25, 50, 75, 90, 95, 99, 100)


@dataclass
class Outcome:
    ttft_ms: list[float]
    errors: int = 0
    prompt_tokens: float = 0.0
    cached_tokens: float = 0.0
    computed: list[float] = field(default_factory=list)  # prompt tokens each prefill computed (not cached)

    def pct(self, q: float) -> float:
        s = sorted(self.ttft_ms)
        return s[min(len(s) - 1, int(len(s) * q / 100))] if s else float("nan")

    @property
    def hit_rate(self) -> float:
        return self.cached_tokens / self.prompt_tokens if self.prompt_tokens else float("nan")

    @property
    def busiest_share(self) -> float:
        return max(self.computed, default=0.0) / max(sum(self.computed), 1.0)


@dataclass(frozen=True)
class Run:
    workload: str  # the label of the table's row: a held-out shape's name, or the tuning reference's
    seed: int
    order: int  # 1 = measured first in its round
    policy: str
    outcome: Outcome | None  # None: not measured (a missing peer)


def _smg(runs: Sequence[Run], run: Run) -> Outcome | None:
    return next(
        (r.outcome for r in runs if r.policy.startswith("smg") and (r.workload, r.seed) == (run.workload, run.seed)),
        None,
    )


def _p99_vs_smg(runs: Sequence[Run], run: Run) -> float | None:
    smg = _smg(runs, run)
    return run.outcome.pct(99) / smg.pct(99) if run.outcome and smg and smg.ttft_ms else None


def _spread(values: Sequence[float], fmt: Callable[[float], str]) -> str:
    """Median (min-max)."""
    if len(values) == 1:
        return fmt(values[0])
    return f"{fmt(statistics.median(values))} ({fmt(min(values))}-{fmt(max(values))})"


SUMMARY_COLUMNS = ("workload", "policy", "seeds", "requests", "errors", "cache hit rate", "TTFT p50 ms",
                   "TTFT p99 ms", "p99 vs smg", "busiest prefill's share")  # fmt: skip


def summary(title: str, runs: Sequence[Run], notes: Sequence[str]) -> Table:
    """One row per workload and policy: medians over seeds, min-max in brackets."""
    table = Table(title, SUMMARY_COLUMNS, notes=list(notes))
    policies = list(dict.fromkeys(r.policy for r in runs))  # the first round's order: not rotated
    for workload, policy in [(w, p) for w in dict.fromkeys(r.workload for r in runs) for p in policies]:
        mine = [r for r in runs if (r.workload, r.policy) == (workload, policy)]
        done = [(r, r.outcome) for r in mine if r.outcome is not None]
        if not done:
            table.rows.append([workload, policy, len(mine), *[NOT_MEASURED] * (len(SUMMARY_COLUMNS) - 3)])
            continue
        ratios = [x for x in (_p99_vs_smg(runs, r) for r, _ in done) if x is not None]
        table.rows.append([
            workload, policy, len(done), sum(len(o.ttft_ms) for _, o in done), sum(o.errors for _, o in done),
            _spread([o.hit_rate * 100 for _, o in done], lambda v: f"{v:.1f}%"),
            _spread([o.pct(50) for _, o in done], lambda v: f"{v:,.0f}"),
            _spread([o.pct(99) for _, o in done], lambda v: f"{v:,.0f}"),
            _spread(ratios, lambda v: f"{v:.2f}x") if ratios else NOT_MEASURED,
            _spread([o.busiest_share * 100 for _, o in done], lambda v: f"{v:.0f}%"),
        ])  # fmt: skip
    return table


def per_run(runs: Sequence[Run]) -> Table:
    """Every run as measured, in the order measured (the raw numbers the summary is made of)."""
    table = Table(
        "prefix bench: every run (one policy on one workload and seed), in the order measured",
        ["workload", "seed", "order in round", "policy", "requests", "errors", "cache hit rate %",
         "prefill tokens computed", "busiest prefill's share %", "TTFT p50 ms", "TTFT p99 ms", "p99 vs smg"],
    )  # fmt: skip
    for r in runs:
        o = r.outcome
        if o is None:
            table.rows.append([r.workload, r.seed, r.order, r.policy, *[NOT_MEASURED] * 8])
            continue
        ratio = _p99_vs_smg(runs, r)
        table.rows.append([
            r.workload, r.seed, r.order, r.policy, len(o.ttft_ms), o.errors, round(o.hit_rate * 100, 1),
            int(o.prompt_tokens - o.cached_tokens), round(o.busiest_share * 100, 1), round(o.pct(50), 1),
            round(o.pct(99), 1), round(ratio, 3) if ratio is not None else NOT_MEASURED,
        ])  # fmt: skip
    return table


def distribution(runs: Sequence[Run], what: str) -> Table:
    """TTFT at each percentile per policy: the median over ``runs`` of each run's percentile."""
    by_policy: dict[str, list[Outcome]] = {}
    for r in runs:
        if r.outcome is not None:
            by_policy.setdefault(r.policy, []).append(r.outcome)
    return Table(
        f"TTFT distribution per policy, {what} (ms at each percentile, median over runs: the CDF with its axes "
        "swapped)",
        ["percentile", *by_policy],
        rows=[[q, *(statistics.median(o.pct(q) for o in outs) for outs in by_policy.values())] for q in PERCENTILES],
        plot=Plot("line", "percentile", list(by_policy), "TTFT ms", log_y=True),
    )
