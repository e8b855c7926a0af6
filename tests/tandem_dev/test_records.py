"""tandem_dev.records: the figures a test or script measured, saved as JSON with the run's context."""

from __future__ import annotations

import enum
from pathlib import Path

import orjson

from tandem_dev import records


class Verdict(enum.Enum):
    OK = "ok"


def test_a_recorder_saves_every_figure_with_the_context_bench_results_records(tmp_path: Path) -> None:
    record = records.Recorder("tests/test_x.py::test_y[a b]", ["pytest", "-s"], tmp_path)
    record({"streams": {Verdict.OK: 3}, "back_s": 0.2})
    path = record({"back_s": None, "where": tmp_path})
    assert path == tmp_path / "tests_test_x.py_test_y_a_b.json"
    doc = orjson.loads(path.read_bytes())
    assert doc["name"] == "tests/test_x.py::test_y[a b]"
    assert doc["figures"] == {"streams": {"ok": 3}, "back_s": None, "where": str(tmp_path)}
    assert doc["argv"] == ["pytest", "-s"]
    assert {"started_utc", "git", "machine", "peers"} <= doc.keys()
