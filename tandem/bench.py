"""``tandem bench``: runs every component's benchmark section and prints one table per measurement.

A section is a module with ``run(args: BenchArgs) -> list[Table]``, listed in ``SECTIONS``. Sections measure
side by side in one run and report ratios, since absolute times on a shared 2-core machine are noisy.
"""

from __future__ import annotations

import argparse
import importlib
import sys
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field

# section name -> module that defines run(BenchArgs) -> list[Table]
SECTIONS: dict[str, str] = {
    "sim": "tandem_sim.bench",
    "router": "tandem_router.bench",
    "operator": "tandem_operator.bench",
}


@dataclass(frozen=True)
class BenchArgs:
    quick: bool = False  # smaller runs (used by the tests that check the benchmarks themselves work)


@dataclass
class Table:
    title: str
    columns: Sequence[str]
    rows: list[Sequence[object]] = field(default_factory=list)
    notes: list[str] = field(default_factory=list)

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
    parser = argparse.ArgumentParser(prog="tandem bench", description=__doc__)
    parser.add_argument("sections", nargs="*", help=f"sections to run (default: all): {', '.join(SECTIONS)}")
    parser.add_argument("--quick", action="store_true", help="short runs, for smoke-testing the benchmarks")
    args = parser.parse_args(argv)
    unknown = [s for s in args.sections if s not in SECTIONS]
    if unknown:
        parser.error(f"unknown section(s): {', '.join(unknown)}; known: {', '.join(SECTIONS)}")
    for name in args.sections or list(SECTIONS):
        started = time.monotonic()
        print(f"# bench section: {name}", flush=True)
        run: Callable[[BenchArgs], list[Table]] = importlib.import_module(SECTIONS[name]).run
        for table in run(BenchArgs(quick=args.quick)):
            print(table.render(), flush=True)
        print(f"# section {name} took {time.monotonic() - started:.1f}s\n", flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
