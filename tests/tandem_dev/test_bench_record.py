"""``tandem bench --record`` / ``python -m tandem_dev.bench.record``: a results folder becomes one markdown record per
section (context, tables, notes, seconds, PNGs beside it) and the index in the records README; bad input fails with
one line and writes nothing; a failed section is reported, not recorded."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest

from tandem_dev import bench
from tandem_dev.bench import record
from tandem_dev.bench import run as bench_run
from tests.test_readme_tables import ROOT, problems, tables

PNG = b"\x89PNG\r\n\x1a\n" + b"\x00" * 16
STAMP = "20261207T034632Z"


def results_doc(**sections: Any) -> dict[str, Any]:
    return {
        "started_utc": "2026-12-07T03:46:32Z",
        "argv": ["tenants", "--allow-missing-peers"],
        "git": {"commit": "56ce744ce58a4a096d23f0ceae76973ba391fe4c", "dirty": True},
        "machine": {
            "cores": 2,
            "load_average_at_start": [1.2958984375, 3.23876953125, 3.0537109375],
            "platform": "Linux-test",
            "python": "3.11.7",
        },
        "peers": {"smg": "1.13.0", "wrk": "4.1.0-3+b2 (not installed)"},
        "sections": sections,
    }


TENANTS = {
    "seconds": 272.5,
    "tables": [
        {
            "title": "quiet tenants' TTFT",
            "columns": ["router", "p99 ms", "ratio"],
            "rows": [["flow control", 41.92928500197013, "2.07x"], ["a|b", "not measured", "-"]],
            "notes": ["target: <= 1.5x", "load average (1 min) 1.3 at start"],
            "plot": "tenants-0.png",
        },
        {
            "title": "flow control's cost",
            "columns": ["router", "req/s"],
            "rows": [["on", 1234.5678], ["off", 142]],
            "notes": [],
        },
    ],
}


def results_folder(tmp_path: Path, doc: dict[str, Any], name: str = STAMP) -> Path:
    folder = tmp_path / "build" / "bench" / name
    folder.mkdir(parents=True)
    (folder / "results.json").write_text(json.dumps(doc))
    (folder / "tenants-0.png").write_bytes(PNG)
    return folder


def test_a_section_becomes_a_record_with_context_tables_notes_and_its_png(tmp_path: Path) -> None:
    folder, docs = results_folder(tmp_path, results_doc(tenants=TENANTS)), tmp_path / "docs"
    assert record.main([str(folder), "--records-dir", str(docs)]) == 0
    text = (docs / "tenants" / f"{STAMP}.md").read_text()
    lines = text.splitlines()
    assert lines[0].startswith("<!-- Produced by `python -m tandem_dev.bench.record ")
    assert "do not edit by hand" in lines[0]
    assert "# tenants: 2026-12-07T03:46:32Z" in lines
    assert "Measured by `tandem bench tenants --allow-missing-peers`." in lines
    for line in [
        "- git commit: `56ce744ce58a4a096d23f0ceae76973ba391fe4c` (with uncommitted changes)",
        "- started (UTC): 2026-12-07T03:46:32Z",
        "- cores: 2",
        "- load average at start: 1.30 / 3.24 / 3.05 (1 / 5 / 15 min)",
        "- platform: Linux-test, Python 3.11.7",
        "- peers: smg 1.13.0, wrk 4.1.0-3+b2 (not installed)",
        "- section took: 272.5 s",
    ]:
        assert line in lines, line
    first = lines.index("## quiet tenants' TTFT")
    assert lines[first + 2 : first + 6] == [
        "| router | p99 ms | ratio |",
        "|---|---|---|",  # "not measured" in a column of numbers: not right-aligned
        "| flow control | 41.9 | 2.07x |",
        "| a\\|b | not measured | - |",
    ]
    assert lines[first + 6 : first + 11] == [
        "",
        "Notes:",
        "",
        "- target: <= 1.5x",
        "- load average (1 min) 1.3 at start",
    ]
    assert f"![tenants table 0: quiet tenants' TTFT]({STAMP}-0.png)" in lines
    second = lines.index("## flow control's cost")
    assert lines[second + 2 : second + 6] == ["| router | req/s |", "|---|---:|", "| on | 1,235 |", "| off | 142 |"]
    assert "Notes:" not in lines[second:]
    assert (docs / "tenants" / f"{STAMP}-0.png").read_bytes() == PNG
    assert sorted(p.name for p in (docs / "tenants").iterdir()) == [f"{STAMP}-0.png", f"{STAMP}.md"]


def test_the_index_lists_every_record_newest_first_and_keeps_the_readme_text(tmp_path: Path) -> None:
    docs = tmp_path / "docs"
    older = results_doc(tenants=TENANTS, probing=TENANTS) | {"started_utc": "2026-12-06T01:00:00Z"}
    older["git"] = {"commit": "a" * 40, "dirty": False}
    assert record.main([str(results_folder(tmp_path, older, "old")), "--records-dir", str(docs)]) == 0
    readme = docs / "README.md"
    assert "## Producing a record" in readme.read_text()  # created from the default text
    custom = readme.read_text().replace("# Benchmark records", "# Benchmark records (edited prose)")
    readme.write_text(custom)
    assert record.main([str(results_folder(tmp_path, results_doc(tenants=TENANTS))), "--records-dir", str(docs)]) == 0
    text = readme.read_text()
    assert text.startswith("# Benchmark records (edited prose)\n")
    index = text.partition(record.INDEX_START)[2].partition(record.INDEX_END)[0].strip().splitlines()
    assert index == [
        "### probing",  # tandem bench's order of sections, not the order of the runs
        "",
        "- [2026-12-06 01:00:00 UTC](probing/20261206T010000Z.md): commit aaaaaaaaaaaa",
        "",
        "### tenants",
        "",
        f"- [2026-12-07 03:46:32 UTC](tenants/{STAMP}.md): commit 56ce744ce58a (uncommitted changes)",
        "- [2026-12-06 01:00:00 UTC](tenants/20261206T010000Z.md): commit aaaaaaaaaaaa",
    ]
    assert tables("docs/benchmarks/README.md", text) == []  # a list: README tables must name a command


def test_recording_the_same_run_again_rewrites_the_same_files(tmp_path: Path) -> None:
    folder, docs = results_folder(tmp_path, results_doc(tenants=TENANTS)), tmp_path / "docs"
    assert record.main([str(folder), "--records-dir", str(docs)]) == 0
    before = {p: p.read_bytes() for p in docs.rglob("*") if p.is_file()}
    assert record.main([str(folder), "--records-dir", str(docs)]) == 0
    assert {p: p.read_bytes() for p in docs.rglob("*") if p.is_file()} == before


def _one_line_error(capsys: pytest.CaptureFixture[str]) -> str:
    captured = capsys.readouterr()
    assert captured.out == ""
    assert "Traceback" not in captured.err
    assert len(captured.err.strip().splitlines()) == 1, captured.err
    return captured.err


def test_a_folder_without_results_json_is_one_line_and_writes_nothing(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    (tmp_path / "running").mkdir()
    docs = tmp_path / "docs"
    assert record.main([str(tmp_path / "running"), "--records-dir", str(docs)]) == 2
    assert "has no results.json" in _one_line_error(capsys)
    assert record.main([str(tmp_path / "absent"), "--records-dir", str(docs)]) == 2
    assert "is no folder" in _one_line_error(capsys)
    assert not docs.exists()


@pytest.mark.parametrize(
    ("change", "message"),
    [
        (lambda doc: doc.update(argv=["tenants", "--quick"]), "--quick run"),
        (lambda doc: doc.update(started_utc="yesterday"), "is not a UTC time"),
        (lambda doc: doc.pop("sections"), "has no sections"),
        (lambda doc: doc["sections"]["tenants"]["tables"][0].update(plot="gone.png"), "its plot 'gone.png' is not in"),
        (lambda doc: doc["sections"]["tenants"]["tables"][1]["rows"].append([1]), "does not have the 2 columns"),
        (lambda doc: doc["sections"]["tenants"].pop("tables"), "has neither tables nor a failure"),
    ],
)
def test_malformed_results_are_one_line_and_write_nothing(
    tmp_path: Path, capsys: pytest.CaptureFixture[str], change: Any, message: str
) -> None:
    doc = json.loads(json.dumps(results_doc(tenants=TENANTS)))
    change(doc)
    docs = tmp_path / "docs"
    assert record.main([str(results_folder(tmp_path, doc)), "--records-dir", str(docs)]) == 2
    assert message in _one_line_error(capsys)
    assert not docs.exists()


def test_invalid_json_is_one_line(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    folder = results_folder(tmp_path, {})
    (folder / "results.json").write_text('{"sections": ')
    assert record.main([str(folder), "--records-dir", str(tmp_path / "docs")]) == 2
    assert "is not valid JSON" in _one_line_error(capsys)


def test_a_failed_section_is_reported_failed_and_gets_no_record(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    doc = results_doc(tenants=TENANTS, probing={"failed": "peer smg (1.13.0) is not installed here: run `make peers`"})
    docs = tmp_path / "docs"
    assert record.main([str(results_folder(tmp_path, doc)), "--records-dir", str(docs)]) == 1
    captured = capsys.readouterr()
    assert captured.err.strip().splitlines() == [
        "python -m tandem_dev.bench.record: section probing FAILED in that run, not recorded: "
        "peer smg (1.13.0) is not installed here: run `make peers`"
    ]
    assert f"tenants/{STAMP}.md" in captured.out
    assert not (docs / "probing").exists()
    assert (docs / "tenants" / f"{STAMP}.md").is_file()


def test_section_picks_one_and_an_absent_one_is_one_line(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    folder, docs = results_folder(tmp_path, results_doc(tenants=TENANTS, probing=TENANTS)), tmp_path / "docs"
    assert record.main([str(folder), "--section", "probing", "--records-dir", str(docs)]) == 0
    assert [p.name for p in docs.iterdir() if p.is_dir()] == ["probing"]
    capsys.readouterr()
    assert record.main([str(folder), "--section", "router", "--records-dir", str(docs)]) == 2
    assert "has no section router (it has: tenants, probing)" in _one_line_error(capsys)


def test_tandem_bench_record_is_the_same_command(tmp_path: Path) -> None:
    folder, docs = results_folder(tmp_path, results_doc(tenants=TENANTS)), tmp_path / "docs"
    assert bench_run.main(["record", str(folder), "--records-dir", str(docs)]) == 0
    assert (docs / "tenants" / f"{STAMP}.md").read_text().startswith("<!-- Produced by `tandem bench record ")


FAKE_SECTION = """
from tandem_dev.bench import BenchArgs, Plot, Table


def run(args: BenchArgs) -> list[Table]:
    table = Table("fake", ["target", "req/s"], plot=Plot("bar", "target", ["req/s"], "req/s"), notes=["a note"])
    table.rows += [["tandem", 10.0], ["smg", 5.0]]
    return [table]
"""


def test_bench_record_flag_records_the_run_it_just_made(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    (tmp_path / "fake_record_section.py").write_text(FAKE_SECTION)
    monkeypatch.syspath_prepend(str(tmp_path))
    monkeypatch.setattr(bench, "SECTIONS", {"fake": "fake_record_section"})
    out, docs = tmp_path / "out", tmp_path / "docs"
    assert bench_run.main(["fake", "--results-dir", str(out), "--record", "--records-dir", str(docs)]) == 0
    (md,) = (docs / "fake").glob("*.md")
    text = md.read_text()
    assert text.startswith("<!-- Produced by `tandem bench fake --results-dir ")
    assert "| tandem | 10 |" in text
    assert "- a note" in text
    assert (docs / "fake" / f"{md.stem}-0.png").read_bytes()[:8] == PNG[:8]
    assert f"](fake/{md.name})" in (docs / "README.md").read_text()


def test_bench_record_refuses_a_quick_run() -> None:
    with pytest.raises(SystemExit) as exited:
        bench_run.main(["tenants", "--quick", "--record"])
    assert exited.value.code == 2


def test_the_records_readme_index_is_what_the_writer_makes() -> None:
    """docs/benchmarks/README.md is written by the command: its index lists the records there, and it has no
    table (tests/test_readme_tables.py would take one for a measurement)."""
    docs = ROOT / "docs" / "benchmarks"
    text = (docs / "README.md").read_text()
    index = text.partition(record.INDEX_START)[2].partition(record.INDEX_END)[0]
    assert index.strip().splitlines() == record.index_lines(docs)
    assert tables("docs/benchmarks/README.md", text) == []
    assert problems("docs/benchmarks/README.md", text) == []
    for md in docs.glob("*/*.md"):
        if md.parent.name == "history":  # hand-written notes of measurements from before records (issue #37, item 6)
            assert not record.STAMP.match(md.stem), md
            continue
        assert md.read_text().startswith("<!-- Produced by `"), md
