"""``tandem bench router``'s tail at high concurrency (issue #42): p50, p99, p99.9 and max latency per target at
256, 1,000 and 4,000 connections, side by side in one run, and a PNG of each target's latency distribution.

The targets are those of the router-cost section (``bench.py``: the same instant PD workers reached directly,
through ``tandem router`` at its defaults, integrity and flow control on, and through smg). ``wrk`` (one thread,
``--timeout 10s``, a Lua ``done`` hook that prints the percentiles of its latency histogram) runs each level for
every target in turn, in ``ROUNDS`` rounds that start with a different target each time; the table gives the
median over the rounds of each percentile, and the largest max. A wrk connection opens at the start of a run, so
each run also measures the burst of a thousand clients arriving at once.

Each run also reads what bounds it: the target's own CPU (its process group, from /proc, in cores) and how busy the
whole machine was (``/proc/stat``). A single-process router at one core while the machine has idle time left is
bound by its one event loop; a target using more than one core is using threads or processes the other is not.
"""

from __future__ import annotations

import re
import statistics
import subprocess
import time
from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass
from pathlib import Path

import orjson

from tandem_dev.bench import NOT_MEASURED, Table

LEVELS = (256, 1000, 4000)
QUICK_LEVELS = (256,)
PERCENTILES = (50.0, 90.0, 99.0, 99.9)
TIMEOUT_S = 10
ROUNDS = 3

_DONE = """
function done(summary, latency, requests)
  for _, p in ipairs({50, 90, 99, 99.9}) do io.write(string.format("pct %g %d\\n", p, latency:percentile(p))) end
  io.write(string.format("pct max %d\\n", latency.max))
end
"""


@dataclass(frozen=True)
class Tail:
    """One wrk run: requests per second, latency percentiles and max (ms), failed requests."""

    rps: float
    pct: dict[float, float]
    max_ms: float
    errors: int  # non-2xx responses, socket errors and timeouts
    cores: float | None = None  # the target's CPU over the run, in cores (None: not read)
    machine_busy: float | None = None  # the share of the machine's CPU time that was busy over the run


@dataclass(frozen=True)
class TailTarget:
    name: str
    url: str
    body: dict[str, object]
    cpu_seconds: Callable[[], float] | None = None  # the target's CPU time so far (None: not read, e.g. direct)


def machine_times() -> tuple[int, int]:
    """All CPUs' time and their idle + iowait time so far (``/proc/stat``, clock ticks)."""
    with open("/proc/stat") as stat:
        ticks = [int(x) for x in stat.readline().split()[1:]]
    return sum(ticks), ticks[3] + ticks[4]


def measured(target: TailTarget, connections: int, path: str, seconds: int, workdir: Path) -> Tail:
    """One wrk run at ``target`` with the target's CPU and the machine's busy share over it."""
    cpu0 = target.cpu_seconds() if target.cpu_seconds else 0.0
    (total0, idle0), started = machine_times(), time.monotonic()
    tail = wrk_tail(target.url, path, target.body, connections, seconds, workdir)
    (total1, idle1), wall = machine_times(), time.monotonic() - started
    cores = (target.cpu_seconds() - cpu0) / wall if target.cpu_seconds else None
    busy = 1 - (idle1 - idle0) / max(total1 - total0, 1)
    return Tail(tail.rps, tail.pct, tail.max_ms, tail.errors, cores, busy)


def wrk_tail(url: str, path: str, body: dict[str, object], connections: int, seconds: int, workdir: Path) -> Tail:
    script = workdir / "tail.lua"
    script.write_text(
        'wrk.method = "POST"\nwrk.headers["Content-Type"] = "application/json"\n'
        f"wrk.body = [[{orjson.dumps(body).decode()}]]\n{_DONE}"
    )
    argv = ["wrk", "-t1", f"-c{connections}", f"-d{seconds}s", f"--timeout={TIMEOUT_S}s", "-s", str(script)]
    out = subprocess.run(
        [*argv, url + path], check=True, capture_output=True, text=True, timeout=seconds + TIMEOUT_S + 30
    ).stdout
    return parse(out)


def parse(out: str) -> Tail:
    """wrk's summary and the ``done`` hook's percentile lines (microseconds)."""
    found = dict(re.findall(r"^pct (\S+) (\d+)$", out, re.M))
    rps = float(re.search(r"Requests/sec:\s+([\d.]+)", out).group(1))  # type: ignore[union-attr]
    return Tail(rps, {p: int(found[f"{p:g}"]) / 1000 for p in PERCENTILES}, int(found["max"]) / 1000, errors(out))


def errors(out: str) -> int:
    """wrk's non-2xx responses plus its socket errors (connect, read, write, timeout)."""
    failed = int(m.group(1)) if (m := re.search(r"Non-2xx or 3xx responses:\s+(\d+)", out)) else 0
    return failed + sum(int(x) for x in re.findall(r"(?:connect|read|write|timeout) (\d+)", out))


def measure(
    targets: Sequence[TailTarget], path: str, levels: Sequence[int], seconds: int, rounds: int, workdir: Path
) -> dict[str, dict[int, list[Tail]]]:
    """Every level for every target, in ``rounds`` rounds, each starting with the next target."""
    runs: dict[str, dict[int, list[Tail]]] = {t.name: {c: [] for c in levels} for t in targets}
    for r in range(rounds):
        for connections in levels:
            for t in [*targets[r % len(targets) :], *targets[: r % len(targets)]]:
                runs[t.name][connections].append(measured(t, connections, path, seconds, workdir))
    return runs


def table(runs: dict[str, dict[int, list[Tail]]], levels: Sequence[int], seconds: int, reference: str) -> Table:
    """The tail table (medians over the rounds), ``reference``'s p99 as the yardstick, and the distribution PNG."""
    out = Table(
        f"router tail at high concurrency: instant PD workers, wrk --timeout {TIMEOUT_S}s (median of the rounds)",
        [
            "connections",
            "target",
            "req/s",
            "p50 ms",
            "p90 ms",
            "p99 ms",
            "p99.9 ms",
            "max ms",
            "p99 vs ref",
            "errors",
            "CPU cores",
            "machine busy",
        ],
        figure=lambda png: plot_distribution(runs, levels, png),
    )
    for connections in levels:
        ref = runs.get(reference, {}).get(connections)
        ref_p99 = statistics.median(t.pct[99.0] for t in ref) if ref else None
        for name, by_level in runs.items():
            tails = by_level[connections]
            if not tails:
                out.rows.append([connections, name, *[NOT_MEASURED] * (len(out.columns) - 2)])
                continue
            pct = {p: statistics.median(t.pct[p] for t in tails) for p in PERCENTILES}
            out.rows.append(
                [
                    connections,
                    name,
                    statistics.median(t.rps for t in tails),
                    *(pct[p] for p in PERCENTILES),
                    max(t.max_ms for t in tails),
                    f"{pct[99.0] / ref_p99:.2f}x" if ref_p99 else NOT_MEASURED,
                    sum(t.errors for t in tails),
                    _median_of(t.cores for t in tails),
                    f"{statistics.median(t.machine_busy or 0.0 for t in tails):.0%}",
                ]
            )
    rounds = max((len(v) for by_level in runs.values() for v in by_level.values()), default=0)
    out.notes += [
        f"{rounds} rounds of {seconds}s wrk runs per target and level, the targets interleaved and each round "
        f"starting with the next one; 'p99 vs ref': the p99 over {reference}'s",
        "latency as wrk measures it: from a request's write to its response's end (the 16-chunk stream), per "
        "connection, so a connection that waits shows in the tail; errors: non-2xx, socket errors and timeouts "
        "summed over the rounds",
        "CPU cores: the target's own CPU time (all its processes, from /proc) over the run's wall time; machine busy: "
        "the share of all cores' time not idle over the run (wrk and the workers included): a target at 1.0 core "
        "while the machine has idle time left is bound by its one process",
    ]
    return out


def _median_of(values: Iterable[float | None]) -> float | str:
    known = [v for v in values if v is not None]
    return round(statistics.median(known), 2) if known else "-"


def plot_distribution(runs: dict[str, dict[int, list[Tail]]], levels: Sequence[int], path: Path) -> None:
    """Latency at each percentile (median over the rounds), one panel per level, one line per target."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    marks = [*PERCENTILES, 100.0]
    xs = list(range(len(marks)))
    fig, axes = plt.subplots(1, len(levels), figsize=(5 * len(levels), 4), dpi=100, squeeze=False)
    for ax, connections in zip(axes[0], levels, strict=True):
        for name, by_level in runs.items():
            tails = by_level[connections]
            if not tails:
                continue
            ys = [statistics.median(t.pct[p] for t in tails) for p in PERCENTILES]
            ax.plot(xs, [*ys, max(t.max_ms for t in tails)], marker="o", label=name)
        ax.set_xticks(xs, [f"p{p:g}" for p in PERCENTILES] + ["max"])
        ax.set_yscale("log")
        ax.set_title(f"{connections} connections")
        ax.set_ylabel("latency (ms)")
        ax.grid(True, which="both", alpha=0.3)
        ax.legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(path)
    plt.close(fig)
