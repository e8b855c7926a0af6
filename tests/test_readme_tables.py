"""Every README table of measurements names the command that writes it, and that command saves results JSON
(issue #41, item 9): no table of figures is copied from a run nobody can repeat.

The rule: a table is *reference* (flags, fields, defaults, fidelity rows: no measurement) only when its header row
is listed in ``REFERENCE`` below; every other table is a measurement, so a new table must either name its command
or be listed here on purpose. A measurement table (with the tables right next to it, separated only by blank
lines) must name, in an inline code span of the paragraph right above it or right below it, a command that saves
JSON: ``tandem bench <section>`` (a real section; tandem_dev.bench.results), ``tandem chaos``, a ``make`` target
whose recipe runs one of these, ``python -m <module>`` whose source saves with tandem_dev.records or
tandem_dev.bench.results, or ``pytest <test file>`` whose tests use the ``record`` fixture (tests/conftest.py).
Env assignments, ``scripts/in-netns.sh`` and ``.venv/bin/`` in front are allowed. Figures of one-off runs (a
before/after across two commits, a micro-benchmark) are prose, never a table.
"""

from __future__ import annotations

import importlib.util
import re
import shlex
from dataclasses import dataclass
from pathlib import Path

import pytest

from tandem.cli import SUBCOMMANDS
from tandem_dev.bench import SECTIONS

ROOT = Path(__file__).resolve().parents[1]
READMES = [
    "README.md",
    "charts/tandem/README.md",
    "images/README.md",
    "operator/README.md",
    "router/README.md",
    "simulator/README.md",
]

# (README, header row with single spaces): tables that hold no measurement.
REFERENCE: set[tuple[str, str]] = {
    ("README.md", "| folder | what |"),
    ("charts/tandem/README.md", "| Key | Default | Description |"),
    ("charts/tandem/README.md", "| pod | port | allowed from |"),
    ("images/README.md", "| image | built from | what runs in it |"),
    ("images/README.md", "| input | pinned by | not pinned |"),
    ("images/README.md", "| claim | verified by |"),
    ("images/README.md", "| pin | where | must match |"),
    ("operator/README.md", "| system | where the decision runs | how it acts |"),
    ("operator/README.md", "| port (PDCluster field) | what answers there | what a stranger can do |"),
    ("operator/README.md", "| setting | value | why |"),
    ("simulator/README.md", "| profile | prefill ms/token | decode base ms | ms per seq | ms per KV token | use |"),
    ("simulator/README.md", "| behaviour | SGLang / Mooncake source (file: function) | simulated |"),
    ("simulator/README.md", "| behaviour | SGLang source (file: function) | simulated |"),
    ("simulator/README.md", "| behaviour | SGLang 0.5.23 source (file: function) | simulated |"),
    ("simulator/README.md", "| behaviour | real SGLang 0.5.23 / Mooncake 0.3.13.post1 | `tandem sim` |"),
}

MODULE_SAVES = re.compile(r"\brecords\.save\(|\bResults\.start\(")
TEST_RECORDS = re.compile(r"\brecord\(")
DELIMITER = re.compile(r"^\|(\s*:?-+:?\s*\|)+$")
HEADING = re.compile(r"^#{1,6} ")


@dataclass(frozen=True)
class TableGroup:
    """Tables separated only by blank lines, with the paragraphs right above and right below them."""

    readme: str
    line: int  # 1-based line of the first table's header
    headers: list[str]
    above: str
    below: str


def _header(line: str) -> str:
    return " ".join(line.split())


def _is_table_start(lines: list[str], i: int) -> bool:
    return lines[i].startswith("|") and i + 1 < len(lines) and bool(DELIMITER.match(lines[i + 1].strip()))


def _paragraph(lines: list[str], start: int, step: int) -> str:
    """The text from ``start`` on (``step`` -1: upwards) past blank lines, up to a blank line, a table or a heading
    (a heading right above a table is its context)."""
    i, out = start, []
    while 0 <= i < len(lines) and not lines[i].strip():
        i += step
    while 0 <= i < len(lines) and lines[i].strip() and not lines[i].startswith("|"):
        out.append(lines[i])
        if HEADING.match(lines[i]):
            break
        i += step
    return " ".join(reversed(out) if step < 0 else out)


def tables(readme: str, text: str) -> list[TableGroup]:
    lines = text.splitlines()
    groups: list[TableGroup] = []
    i, fence = 0, False
    while i < len(lines):
        if lines[i].startswith("```"):
            fence = not fence
        if fence or not _is_table_start(lines, i):
            i += 1
            continue
        start, headers = i, []
        while i < len(lines) and _is_table_start(lines, i):
            headers.append(_header(lines[i]))
            while i < len(lines) and lines[i].startswith("|"):
                i += 1
            after = i
            while after < len(lines) and not lines[after].strip():
                after += 1
            if after < len(lines) and _is_table_start(lines, after):
                i = after
        groups.append(TableGroup(readme, start + 1, headers, _paragraph(lines, start - 1, -1), _paragraph(lines, i, 1)))
    return groups


def _makefile_recipe(root: Path, target: str) -> list[str] | None:
    lines = (root / "Makefile").read_text().splitlines()
    for n, line in enumerate(lines):
        if re.match(rf"^{re.escape(target)}\s*:(?!=)", line):
            recipe = []
            for body in lines[n + 1 :]:
                if not body.startswith("\t"):
                    break
                recipe.append(body.strip().lstrip("@-"))
            return recipe
    return None


def _module_source(module: str) -> str | None:
    try:
        spec = importlib.util.find_spec(module)
    except ModuleNotFoundError:
        return None
    if spec is None or spec.origin is None or not spec.origin.endswith(".py"):
        return None
    return Path(spec.origin).read_text()


def saves_json(command: str, root: Path = ROOT, depth: int = 0) -> str | None:
    """None when ``command`` runs something that saves its results as JSON; else why not."""
    for var, value in (("$(PYTEST)", "python -m pytest"), ("$(PY)", "python"), ("$(VENV)/bin/", "")):
        command = command.replace(var, value)
    command = re.sub(r"\$\(\w+\)", "", command)  # a recipe's optional arguments (BENCH_ARGS)
    try:
        words = shlex.split(command)
    except ValueError:
        words = command.split()
    while words and (re.match(r"^[A-Z_][A-Z0-9_]*=", words[0]) or words[0] in ("env", "scripts/in-netns.sh")):
        words = words[1:]
    if not words:
        return "no command"
    head = words[0].removeprefix(".venv/bin/")
    if head == "tandem" and len(words) > 1:
        if words[1] not in SUBCOMMANDS:
            return f"`tandem {words[1]}` is no tandem command"
        if words[1] == "bench":
            unknown = [w for w in words[2:] if not w.startswith("-") and w not in SECTIONS]
            if unknown:
                return f"no bench section {unknown}"
        source = _module_source(SUBCOMMANDS[words[1]][0])
        return None if source and MODULE_SAVES.search(source) else f"`tandem {words[1]}` saves no JSON"
    if head == "make" and len(words) > 1 and depth < 3:
        recipe = _makefile_recipe(root, words[1])
        if recipe is None:
            return f"no make target {words[1]}"
        if any(saves_json(line, root, depth + 1) is None for line in recipe):
            return None
        return f"`make {words[1]}` runs nothing that saves JSON"
    if head in ("python", "python3") and len(words) > 2 and words[1] == "-m" and words[2] != "pytest":
        source = _module_source(words[2])
        if source is None:
            return f"no module {words[2]}"
        return None if MODULE_SAVES.search(source) else f"`python -m {words[2]}` saves no JSON"
    if head == "pytest" or (head in ("python", "python3") and words[1:3] == ["-m", "pytest"]):
        files = [root / w.split("::")[0] for w in words if w.split("::")[0].endswith(".py")]
        if not files:
            return "pytest without a test file"
        for f in files:
            if not f.is_file():
                return f"no test file {f}"
            if not TEST_RECORDS.search(f.read_text()):
                return f"{f.name} records nothing (the `record` fixture)"
        return None
    return "not a command that saves JSON"


def commands_named(text: str) -> dict[str, str | None]:
    """Every inline code span of ``text`` with why it is not a JSON-saving command (None: it is one)."""
    return {span: saves_json(span) for span in re.findall(r"`([^`]+)`", text)}


def problems(readme: str, text: str) -> list[str]:
    out = []
    for group in tables(readme, text):
        keys = {(readme, h) for h in group.headers}
        if keys <= REFERENCE:
            continue
        named = commands_named(f"{group.above} {group.below}")
        if not any(why is None for why in named.values()):
            tried = "; ".join(f"`{span}`: {why}" for span, why in named.items() if not span.startswith("--")) or "-"
            out.append(
                f"{readme}:{group.line} {group.headers[0][:80]}: a measurement table must name the command that "
                f"writes it (one that saves JSON) in the paragraph right above or below it, or be listed in "
                f"REFERENCE if it measures nothing. Code spans there: {tried[:600]}"
            )
    return out


def test_every_measurement_table_names_a_command_that_saves_json() -> None:
    found = [p for readme in READMES for p in problems(readme, (ROOT / readme).read_text())]
    assert not found, "\n".join(found)


def test_every_readme_with_a_table_is_checked() -> None:
    candidates = [*ROOT.glob("README.md"), *ROOT.glob("*/README.md"), *ROOT.glob("*/*/README.md")]
    skipped = {".venv", "build", "node_modules", ".git"}
    with_tables = {
        str(p.relative_to(ROOT))
        for p in candidates
        if p.relative_to(ROOT).parts[0] not in skipped and tables(str(p), p.read_text())
    }
    assert with_tables <= set(READMES)


def test_the_lists_name_tables_that_exist() -> None:
    headers = {(r, h) for r in READMES for g in tables(r, (ROOT / r).read_text()) for h in g.headers}
    assert REFERENCE - headers == set()


BROKEN = """# Bench

Measured on a 2-core machine:

| connections | req/s |
|---|---|
| 32 | 1,000 |
"""


@pytest.mark.parametrize(
    ("paragraph", "ok"),
    [
        ("Measured on a 2-core machine:", False),
        ("Measured (`tandem bench router`, 2-core machine):", True),
        ("Measured (`TANDEM_BENCH_OPERATOR_GROUPS=250 tandem bench\noperator`):", True),
        ("Measured (`tandem bench no-such-section`):", False),
        ("Measured (`make bench`):", True),
        ('Measured (`make chaos-dev-cluster CHAOS_ARGS="--duration 120"`):', True),
        ("Measured (`make lint`):", False),
        ("Measured (`make no-such-target`):", False),
        ("Measured (`scripts/in-netns.sh .venv/bin/python -m pytest -s tests/test_registry_outage.py`):", True),
        ("Measured (`python -m pytest -s tests/tandem/test_cli.py`: it records nothing):", False),
        ("Measured (`python -m pytest -s tests/no_such_test.py`):", False),
        ("Measured (`scripts/in-netns.sh .venv/bin/python -m tests.plumbing.recovery_local`):", True),
        ("Measured (`python -m tandem_dev.local_stack_cli`: saves nothing):", False),
        ("Measured (`tandem up`):", False),
    ],
)
def test_a_measurement_table_without_a_command_that_saves_json_fails(paragraph: str, ok: bool) -> None:
    text = BROKEN.replace("Measured on a 2-core machine:", paragraph)
    assert (problems("x/README.md", text) == []) is ok


def test_the_command_may_follow_the_table_and_covers_the_tables_next_to_it() -> None:
    second = "\n| a | b |\n|---|---|\n| 1 | 2 |\n\n`tandem chaos` wrote it.\n"
    text = BROKEN.replace("| 32 | 1,000 |\n", f"| 32 | 1,000 |\n{second}")
    (group,) = tables("x/README.md", text)
    assert len(group.headers) == 2
    assert problems("x/README.md", text) == []
    separated = text.replace("\n\n| a | b |", "\n\nA paragraph between.\n\n| a | b |")
    assert len(problems("x/README.md", separated)) == 1  # the first table: its paragraphs name no command


def test_a_reference_table_needs_no_command_and_a_table_in_a_code_block_is_none() -> None:
    reference = "| folder | what |\n|---|---|\n| tests/ | the tests |\n"
    assert problems("README.md", reference) == []
    assert len(problems("other/README.md", reference)) == 1  # listed for README.md only
    assert tables("x/README.md", f"```\n{BROKEN}```\n") == []
