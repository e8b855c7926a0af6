"""``tandem bench``: runs every component's benchmark section and prints one table per measurement.

A section is a module with ``run(args: BenchArgs) -> list[Table]``, listed in ``SECTIONS``. Sections measure
side by side in one run and report ratios, since absolute times on a shared 2-core machine are noisy.

Peers (``smg``, ``wrk``: tandem_dev.peers) are installed by ``make peers`` outside the network namespace. A section
whose peer cannot run fails, naming the peer and how to install it; ``--allow-missing-peers`` instead reports that
row as "not measured". Every run saves its tables (JSON) and plots (PNG) with the git commit, the machine and the
peers' versions under ``build/bench/<UTC timestamp>/`` (``--results-dir``; tandem_dev.bench_results).
"""

from __future__ import annotations

import argparse
import importlib
import sys
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from pathlib import Path

from tandem_dev.peers import PeerMissingError

# section name -> module that defines run(BenchArgs) -> list[Table]
SECTIONS: dict[str, str] = {
    "sim": "tandem_dev.sim.bench",
    "sim-load": "tandem_dev.sim.bench_load",
    "sim-startup": "tandem_dev.sim.bench_startup",
    "router": "tandem_dev.router.bench",
    "streams": "tandem_dev.router.bench_streams",
    "prefix": "tandem_dev.router.bench_prefix",
    "integrity": "tandem_dev.router.bench_integrity",
    "probing": "tandem_dev.router.bench_probing",
    "tenants": "tandem_dev.router.bench_tenants",
    "operator": "tandem_dev.operator.bench",
    "images": "tandem_dev.images.bench",
    "autoscale": "tandem_dev.autoscale_bench",
}
NOT_MEASURED = "not measured"


@dataclass(frozen=True)
class BenchArgs:
    quick: bool = False  # smaller runs (used by the tests that check the benchmarks themselves work)
    allow_missing_peers: bool = False  # a peer that cannot run gives a "not measured" row instead of a failure


@dataclass(frozen=True)
class Plot:
    """How to draw a table as a PNG: one bar group (``kind="bar"``) or line (``"line"``) per column in ``ys``
    against column ``x``. Rows whose values are not numbers (e.g. "not measured") are left out."""

    kind: str
    x: str
    ys: Sequence[str]
    ylabel: str
    log_y: bool = False


@dataclass
class Table:
    title: str
    columns: Sequence[str]
    rows: list[Sequence[object]] = field(default_factory=list)
    notes: list[str] = field(default_factory=list)
    plot: Plot | None = None
    figure: Callable[[Path], None] | None = None  # draws its own PNG at the given path (instead of ``plot``)

    def render(self) -> str:
        cells = [[str(c) for c in self.columns]] + [[_fmt(v) for v in row] for row in self.rows]
        widths = [max(len(row[i]) for row in cells) for i in range(len(self.columns))]
        line = "+".join("-" * (w + 2) for w in widths)
        out = [f"## {self.title}", line]
        for n, row in enumerate(cells):
            out.append("|".join(f" {c.ljust(w)} " for c, w in zip(row, widths, strict=True)))
            if n == 0:
                out.append(line)
        out.append(line)
        out += [f"  note: {note}" for note in self.notes]
        return "\n".join(out)


def _fmt(value: object) -> str:
    if isinstance(value, float):
        return f"{value:,.3g}" if abs(value) < 100 else f"{value:,.0f}"
    return str(value)


def main(argv: Sequence[str]) -> int:
    from tandem_dev import bench_results

    parser = argparse.ArgumentParser(prog="tandem bench", description=__doc__)
    parser.add_argument("sections", nargs="*", help=f"sections to run (default: all): {', '.join(SECTIONS)}")
    parser.add_argument("--quick", action="store_true", help="short runs, for smoke-testing the benchmarks")
    parser.add_argument(
        "--allow-missing-peers",
        action="store_true",
        help='report a peer (smg, wrk) that cannot run here as "not measured" instead of failing the section',
    )
    parser.add_argument("--results-dir", type=Path, help="where to save JSON + PNG (default: build/bench/<UTC time>)")
    args = parser.parse_args(argv)
    unknown = [s for s in args.sections if s not in SECTIONS]
    if unknown:
        parser.error(f"unknown section(s): {', '.join(unknown)}; known: {', '.join(SECTIONS)}")
    results = bench_results.Results.start(args.results_dir, argv)
    print(f"# bench results: {results.folder}", flush=True)
    failed: list[str] = []
    for name in args.sections or list(SECTIONS):
        started = time.monotonic()
        print(f"# bench section: {name}", flush=True)
        run: Callable[[BenchArgs], list[Table]] = importlib.import_module(SECTIONS[name]).run
        try:
            tables = run(BenchArgs(quick=args.quick, allow_missing_peers=args.allow_missing_peers))
        except PeerMissingError as err:
            print(f"# section {name} FAILED: {err} (or pass --allow-missing-peers)", file=sys.stderr, flush=True)
            results.failed(name, str(err))
            failed.append(name)
            continue
        for table in tables:
            print(table.render(), flush=True)
        results.add(name, tables, time.monotonic() - started)
        print(f"# section {name} took {time.monotonic() - started:.1f}s\n", flush=True)
    results.save()
    print(f"# saved: {results.folder}", flush=True)
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
