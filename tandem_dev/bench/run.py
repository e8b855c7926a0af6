"""``tandem bench``: runs every component's benchmark section (``tandem_dev.bench``) and prints one table per
measurement.

Peers (``smg``, ``wrk``: tandem_dev.peers) are installed by ``make peers`` outside the network namespace. A section
whose peer cannot run fails, naming the peer and how to install it; ``--allow-missing-peers`` instead reports that
row as "not measured". Every run saves its tables (JSON) and plots (PNG) with the git commit, the machine and the
peers' versions under ``build/bench/<UTC timestamp>/`` (``--results-dir``; tandem_dev.bench.results).
``--record`` then turns the run into tracked markdown records under ``docs/benchmarks/<section>/`` (``--records-dir``;
tandem_dev.bench.record); ``tandem bench record <results folder>`` records a run already done.
"""

from __future__ import annotations

import argparse
import importlib
import shlex
import sys
import time
from collections.abc import Callable, Sequence
from pathlib import Path

from tandem_dev import bench
from tandem_dev.bench import BenchArgs, Table, record
from tandem_dev.bench.results import Results
from tandem_dev.peers import PeerMissingError


def main(argv: Sequence[str]) -> int:
    if argv and argv[0] == "record":
        return record.main(argv[1:], prog="tandem bench record")
    parser = argparse.ArgumentParser(prog="tandem bench", description=__doc__)
    parser.add_argument("sections", nargs="*", help=f"sections to run (default: all): {', '.join(bench.SECTIONS)}")
    parser.add_argument("--quick", action="store_true", help="short runs, for smoke-testing the benchmarks")
    parser.add_argument(
        "--allow-missing-peers",
        action="store_true",
        help='report a peer (smg, wrk) that cannot run here as "not measured" instead of failing the section',
    )
    parser.add_argument("--results-dir", type=Path, help="where to save JSON + PNG (default: build/bench/<UTC time>)")
    parser.add_argument(
        "--record",
        action="store_true",
        help="after the run, write its markdown records + PNGs and the index (tandem_dev.bench.record); "
        "`tandem bench record <results folder>` records a run already done",
    )
    parser.add_argument(
        "--records-dir", type=Path, default=record.RECORDS, help=f"where --record writes (default: {record.RECORDS})"
    )
    args = parser.parse_args(argv)
    if args.record and args.quick:
        parser.error("--record: a --quick run is a smoke test, not a measurement to keep")
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
    if args.record:
        command = " ".join(["tandem bench", *map(shlex.quote, argv)])
        try:
            outcome = record.write_records(results.folder, args.records_dir, command=command)
        except (record.RecordError, OSError) as err:
            print(f"tandem bench --record: {err}", file=sys.stderr, flush=True)
            return 2
        record.report(outcome, "tandem bench --record")
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
