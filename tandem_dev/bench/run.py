"""``tandem bench``: runs every component's benchmark section (``tandem_dev.bench``) and prints one table per
measurement.

Peers (``smg``, ``wrk``: tandem_dev.peers) are installed by ``make peers`` outside the network namespace. A section
whose peer cannot run fails, naming the peer and how to install it; ``--allow-missing-peers`` instead reports that
row as "not measured". Every run saves its tables (JSON) and plots (PNG) with the git commit, the machine and the
peers' versions under ``build/bench/<UTC timestamp>/`` (``--results-dir``; tandem_dev.bench.results).
"""

from __future__ import annotations

import argparse
import importlib
import sys
import time
from collections.abc import Callable, Sequence
from pathlib import Path

from tandem_dev import bench
from tandem_dev.bench import BenchArgs, Table
from tandem_dev.bench.results import Results
from tandem_dev.peers import PeerMissingError


def main(argv: Sequence[str]) -> int:
    parser = argparse.ArgumentParser(prog="tandem bench", description=__doc__)
    parser.add_argument("sections", nargs="*", help=f"sections to run (default: all): {', '.join(bench.SECTIONS)}")
    parser.add_argument("--quick", action="store_true", help="short runs, for smoke-testing the benchmarks")
    parser.add_argument(
        "--allow-missing-peers",
        action="store_true",
        help='report a peer (smg, wrk) that cannot run here as "not measured" instead of failing the section',
    )
    parser.add_argument("--results-dir", type=Path, help="where to save JSON + PNG (default: build/bench/<UTC time>)")
    args = parser.parse_args(argv)
    unknown = [s for s in args.sections if s not in bench.SECTIONS]
    if unknown:
        parser.error(f"unknown section(s): {', '.join(unknown)}; known: {', '.join(bench.SECTIONS)}")
    results = Results.start(args.results_dir, argv)
    print(f"# bench results: {results.folder}", flush=True)
    failed: list[str] = []
    for name in args.sections or list(bench.SECTIONS):
        started = time.monotonic()
        print(f"# bench section: {name}", flush=True)
        run: Callable[[BenchArgs], list[Table]] = importlib.import_module(bench.SECTIONS[name]).run
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
