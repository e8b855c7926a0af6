"""What a ``tandem bench`` section is (``tandem_dev.bench.run`` runs them): a module with
``run(args: BenchArgs) -> list[Table]``, listed in ``SECTIONS``. Sections measure side by side in one run and
report ratios, since absolute times on a shared 2-core machine are noisy.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from pathlib import Path

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
