"""Turn one ``tandem bench`` results folder (tandem_dev.bench.results: ``results.json`` + PNGs) into the tracked
benchmark history: one markdown record per section at ``<records>/<section>/<UTC timestamp>.md``, that section's
PNGs beside it (``<UTC timestamp>-<n>.png``, n the table's index), and the index of every record in
``<records>/README.md`` rewritten (newest first per section). ``<records>`` is ``docs/benchmarks`` by default.

Records are generated text only: they open with a comment saying so, and a record is changed by rerunning the
command, never by hand. Everything is checked before anything is written, so bad input writes nothing and fails
with one line. A section that failed in that run gets no record and is reported as failed.

    tandem bench <sections> --record                  # run, save under build/bench/<UTC>, then record
    tandem bench record build/bench/<UTC>             # record a run already done
    python -m tandem_dev.bench.record build/bench/<UTC>
"""

from __future__ import annotations

import argparse
import re
import shlex
import shutil
import sys
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import orjson

from tandem_dev import bench
from tandem_dev.bench import _fmt

RECORDS = Path("docs") / "benchmarks"
STAMP = re.compile(r"^\d{8}T\d{6}Z$")
INDEX_START = "<!-- index: produced by `tandem bench --record` / `python -m tandem_dev.bench.record`; do not edit -->"
INDEX_END = "<!-- end of index -->"
HEADER = (
    "<!-- Produced by `{command}` (tandem_dev.bench.record) from {source}: generated text, do not edit by hand; "
    "rerun the command instead. -->"
)
README = f"""# Benchmark records

The history of `tandem bench`: one record per section and run, generated from the results a run saves (its tables,
plots and context: git commit, machine load, peers' versions). The component READMEs are reference; the figures
live here, in records nobody edits by hand.

Each record is `<section>/<UTC timestamp>.md`: the command line that measured it, the context (git commit and whether
the working tree had uncommitted changes, the UTC start, the cores and load average at start, the peers' versions),
every table with its notes, the section's seconds, and its plots (`<UTC timestamp>-<n>.png`, beside it).

## Producing a record

Run the benchmark with `--record` (inside the network namespace, as `make bench` does):

    scripts/in-netns.sh .venv/bin/tandem bench tenants --record
    make bench BENCH_ARGS="tenants --record"

or record a run already saved under `build/bench/<UTC timestamp>/`:

    .venv/bin/python -m tandem_dev.bench.record build/bench/20261207T034632Z

(`tandem bench record <folder>` is the same.) `--section NAME` records only that section of the folder,
`--records-dir DIR` writes elsewhere than `docs/benchmarks`. A `--quick` run is a smoke test and is never recorded; a
section that failed in its run gets no record. Recording again the same run rewrites its records. Every write
regenerates the index below; commit the records, their PNGs and this README together.

## Index

Newest first per section.

{INDEX_START}
{INDEX_END}
"""


class RecordError(Exception):
    """Input that cannot be recorded; the message is the one line the command prints."""


@dataclass(frozen=True)
class SectionRun:
    name: str
    seconds: float | None
    tables: list[dict[str, Any]]
    failed: str | None = None


@dataclass(frozen=True)
class Run:
    folder: Path
    stamp: str
    doc: dict[str, Any]
    sections: list[SectionRun] = field(default_factory=list)


def _display(path: Path) -> str:
    try:
        return str(path.resolve().relative_to(Path.cwd().resolve()))
    except ValueError:
        return str(path)


def load(folder: Path) -> Run:
    """The results folder, checked: a results.json ``tandem bench`` wrote, each table well formed and its PNG there."""
    path = folder / "results.json"
    if not folder.is_dir():
        raise RecordError(
            f"{_display(folder)} is no folder (expected a `tandem bench` results folder: build/bench/<UTC>)"
        )
    if not path.is_file():
        raise RecordError(
            f"{_display(folder)} has no results.json: not a `tandem bench` results folder, or its run has not finished"
        )
    try:
        doc = orjson.loads(path.read_bytes())
    except orjson.JSONDecodeError as err:
        raise RecordError(f"{_display(path)} is not valid JSON ({err})") from None
    if not isinstance(doc, dict) or not isinstance(doc.get("sections"), dict):
        raise RecordError(f"{_display(path)} has no sections: not written by `tandem bench`")
    started = doc.get("started_utc")
    if not isinstance(started, str) or not STAMP.match(stamp := re.sub(r"[-:]", "", started)):
        raise RecordError(f"{_display(path)}: started_utc {started!r} is not a UTC time like 2026-12-07T03:46:32Z")
    argv = doc.get("argv")
    if not isinstance(argv, list) or not all(isinstance(a, str) for a in argv):
        raise RecordError(f"{_display(path)}: argv {argv!r} is not the command's arguments")
    if "--quick" in argv:
        raise RecordError(f"{_display(path)} is a --quick run (a smoke test): not recorded")
    sections = []
    for name, entry in doc["sections"].items():
        where = f"{_display(path)}: section {name}"
        if not isinstance(entry, dict):
            raise RecordError(f"{where} is not an object")
        if "failed" in entry:
            sections.append(SectionRun(name, None, [], failed=str(entry["failed"])))
            continue
        seconds, tables = entry.get("seconds"), entry.get("tables")
        if not isinstance(tables, list):
            raise RecordError(f"{where} has neither tables nor a failure")
        for n, table in enumerate(tables):
            _check_table(folder, f"{where} table {n}", table)
        sections.append(SectionRun(name, float(seconds) if isinstance(seconds, int | float) else None, tables))
    return Run(folder, stamp, doc, sections)


def _check_table(folder: Path, where: str, table: object) -> None:
    if not isinstance(table, dict):
        raise RecordError(f"{where} is not an object")
    columns, rows = table.get("columns"), table.get("rows")
    if not isinstance(table.get("title"), str) or not isinstance(columns, list) or not isinstance(rows, list):
        raise RecordError(f"{where} lacks its title, columns or rows")
    for row in rows:
        if not isinstance(row, list) or len(row) != len(columns):
            raise RecordError(f"{where}: row {row!r} does not have the {len(columns)} columns {columns!r}")
    if not isinstance(table.get("notes", []), list):
        raise RecordError(f"{where}: notes are not a list")
    plot = table.get("plot")
    if plot is not None and not (isinstance(plot, str) and (folder / plot).is_file()):
        raise RecordError(f"{where}: its plot {plot!r} is not in {_display(folder)}")


def _cell(value: object) -> str:
    text = "-" if value is None else _fmt(value)
    return " ".join(text.split()).replace("|", "\\|") or " "


def _is_number(value: object) -> bool:
    return isinstance(value, int | float) and not isinstance(value, bool)


def markdown_table(columns: Sequence[object], rows: Sequence[Sequence[object]]) -> list[str]:
    """A GitHub markdown table; columns whose every value is a number are right-aligned."""
    numeric = [bool(rows) and all(_is_number(row[i]) for row in rows) for i in range(len(columns))]
    out = ["| " + " | ".join(_cell(c) for c in columns) + " |"]
    out.append("|" + "|".join("---:" if right else "---" for right in numeric) + "|")
    out += ["| " + " | ".join(_cell(v) for v in row) + " |" for row in rows]
    return out


def command_line(argv: Sequence[str]) -> str:
    return shlex.join(["tandem", "bench", *argv])


def _object(doc: Mapping[str, Any], key: str) -> dict[str, Any]:
    value = doc.get(key)
    return value if isinstance(value, dict) else {}


def _context_lines(doc: Mapping[str, Any]) -> list[str]:
    git, machine, peers = (_object(doc, key) for key in ("git", "machine", "peers"))
    commit = str(git.get("commit", "unknown"))
    dirty = git.get("dirty")
    tree = "with uncommitted changes" if dirty is True else "clean working tree" if dirty is False else "tree unknown"
    load = machine.get("load_average_at_start")
    load_text = (
        " / ".join(f"{v:.2f}" for v in load) + " (1 / 5 / 15 min)"
        if isinstance(load, list) and load and all(_is_number(v) for v in load)
        else "unknown"
    )
    return [
        f"- git commit: `{commit}` ({tree})",
        f"- started (UTC): {doc.get('started_utc', 'unknown')}",
        f"- cores: {machine.get('cores', 'unknown')}",
        f"- load average at start: {load_text}",
        f"- platform: {machine.get('platform', 'unknown')}, Python {machine.get('python', 'unknown')}",
        "- peers: " + (", ".join(f"{name} {version}" for name, version in peers.items()) or "none recorded"),
    ]


def render(run: Run, section: SectionRun, command: str) -> tuple[str, dict[str, str]]:
    """The record's markdown and the PNGs to copy (source name in the results folder -> name beside the record)."""
    source = _display(run.folder / "results.json")
    out = [HEADER.format(command=command, source=source), "", f"# {section.name}: {run.doc['started_utc']}", ""]
    out += [f"Measured by `{command_line(run.doc['argv'])}`.", ""]
    out += _context_lines(run.doc)
    seconds = "unknown" if section.seconds is None else f"{section.seconds:.1f} s"
    out += [f"- section took: {seconds}", ""]
    pngs: dict[str, str] = {}
    for n, table in enumerate(section.tables):
        out += [f"## {' '.join(table['title'].split())}", ""]
        out += markdown_table(table["columns"], table["rows"])
        notes = [" ".join(str(note).split()) for note in table.get("notes", [])]
        if notes:
            out += ["", "Notes:", ""] + [f"- {note}" for note in notes]
        if table.get("plot"):
            png = f"{run.stamp}-{n}.png"
            pngs[table["plot"]] = png
            alt = re.sub(r"[\[\]]", "", _cell(table["title"]))
            out += ["", f"![{section.name} table {n}: {alt}]({png})"]
        out.append("")
    if not section.tables:
        out += ["(this section reported no tables)", ""]
    return "\n".join(out), pngs


def _commit_of(record: Path) -> str:
    for line in record.read_text().splitlines():
        if line.startswith("- git commit: `"):
            commit, _, rest = line.removeprefix("- git commit: `").partition("`")
            return f"commit {commit[:12]}" + (" (uncommitted changes)" if "uncommitted" in rest else "")
    return "commit unknown"


def index_lines(records: Path) -> list[str]:
    """Every record under ``records``, one list per section (tandem bench's order, then any other by name), newest
    first. A list, not a table: tests/test_readme_tables.py takes every README table for a measurement."""
    found: dict[str, list[Path]] = {}
    for path in records.glob("*/*.md"):
        if STAMP.match(path.stem):
            found.setdefault(path.parent.name, []).append(path)
    order = [s for s in bench.SECTIONS if s in found] + sorted(set(found) - set(bench.SECTIONS))
    if not order:
        return ["No records yet."]
    out: list[str] = []
    for section in order:
        out += [f"### {section}", ""]
        for path in sorted(found[section], key=lambda p: p.stem, reverse=True):
            when = re.sub(r"^(\d{4})(\d\d)(\d\d)T(\d\d)(\d\d)(\d\d)Z$", r"\1-\2-\3 \4:\5:\6 UTC", path.stem)
            out.append(f"- [{when}]({section}/{path.name}): {_commit_of(path)}")
        out.append("")
    return out[:-1]


def write_index(records: Path) -> Path:
    """Rewrite the index part of ``records/README.md`` (the text between its index markers); a README that does not
    exist yet is created from the default text, one without the markers gets them appended."""
    readme = records / "README.md"
    text = readme.read_text() if readme.is_file() else README
    if INDEX_START not in text or INDEX_END not in text.partition(INDEX_START)[2]:
        text = text.rstrip("\n") + f"\n\n## Index\n\n{INDEX_START}\n{INDEX_END}\n"
    before, _, rest = text.partition(INDEX_START)
    _, _, after = rest.partition(INDEX_END)
    body = "\n".join(index_lines(records))
    readme.parent.mkdir(parents=True, exist_ok=True)
    readme.write_text(f"{before}{INDEX_START}\n\n{body}\n\n{INDEX_END}{after}")
    return readme


@dataclass
class Outcome:
    written: list[Path] = field(default_factory=list)
    failed: dict[str, str] = field(default_factory=dict)  # section -> its error in that run


def write_records(
    folder: Path, records: Path = RECORDS, sections: Sequence[str] | None = None, command: str | None = None
) -> Outcome:
    """Record ``sections`` (default: all) of the results ``folder`` under ``records``; raises RecordError (nothing
    written) on bad input. A section that failed in the run is returned in ``failed``, not recorded."""
    run = load(folder)
    names = [s.name for s in run.sections]
    missing = [s for s in sections or [] if s not in names]
    if missing:
        raise RecordError(
            f"{_display(folder)} has no section {', '.join(missing)} (it has: {', '.join(names) or 'none'})"
        )
    command = command or f"python -m tandem_dev.bench.record {_display(folder)}"
    chosen = [s for s in run.sections if sections is None or s.name in sections]
    rendered = [(s, *render(run, s, command)) for s in chosen if s.failed is None]
    outcome = Outcome(failed={s.name: s.failed for s in chosen if s.failed is not None})
    for section, text, pngs in rendered:
        where = records / section.name
        where.mkdir(parents=True, exist_ok=True)
        for source, target in pngs.items():
            shutil.copyfile(run.folder / source, where / target)
        path = where / f"{run.stamp}.md"
        path.write_text(text)
        outcome.written.append(path)
    write_index(records)
    return outcome


def report(outcome: Outcome, prog: str) -> int:
    """Print what was written and what failed; the exit code (1 when a section failed in its run)."""
    for path in outcome.written:
        print(f"# recorded: {_display(path)}", flush=True)
    for name, error in outcome.failed.items():
        print(f"{prog}: section {name} FAILED in that run, not recorded: {error}", file=sys.stderr, flush=True)
    return 1 if outcome.failed else 0


def main(argv: Sequence[str], prog: str = "python -m tandem_dev.bench.record") -> int:
    parser = argparse.ArgumentParser(prog=prog, description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    parser.add_argument("folder", type=Path, help="a `tandem bench` results folder (build/bench/<UTC timestamp>)")
    parser.add_argument("--section", action="append", help="record only this section (repeatable; default: all)")
    parser.add_argument("--records-dir", type=Path, default=RECORDS, help=f"where records go (default: {RECORDS})")
    args = parser.parse_args(argv)
    command = " ".join([prog, shlex.join(argv)])
    try:
        outcome = write_records(args.folder, args.records_dir, args.section, command)
    except (RecordError, OSError) as err:
        print(f"{prog}: {err}", file=sys.stderr)
        return 2
    return report(outcome, prog)


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
