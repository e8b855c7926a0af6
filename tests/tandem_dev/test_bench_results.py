"""``tandem bench``: results saved as JSON + PNG with their context; a missing peer fails loudly unless allowed."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from tandem_dev import bench, peers
from tandem_dev.bench import BenchArgs
from tandem_dev.bench import run as bench_run

SECTIONS = """
from tandem_dev import peers
from tandem_dev.bench import NOT_MEASURED, BenchArgs, Plot, Table


def run(args: BenchArgs) -> list[Table]:
    if not args.allow_missing_peers:
        raise peers.PeerMissingError("peer smg (1.13.0) is not installed here: run `make peers`")
    table = Table("fake", ["target", "req/s"], plot=Plot("bar", "target", ["req/s"], "req/s"))
    table.rows += [["tandem", 10.0], ["smg 1.13.0", NOT_MEASURED]]
    return [table]
"""


@pytest.fixture
def fake_section(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    (tmp_path / "fake_bench_section.py").write_text(SECTIONS)
    monkeypatch.syspath_prepend(str(tmp_path))
    monkeypatch.setattr(bench, "SECTIONS", {"fake": "fake_bench_section"})


@pytest.mark.usefixtures("fake_section")
def test_missing_peer_fails_the_section_naming_the_peer(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    assert bench_run.main(["fake", "--results-dir", str(tmp_path / "out")]) == 1
    err = capsys.readouterr().err
    assert "section fake FAILED: peer smg (1.13.0) is not installed here: run `make peers`" in err
    assert "--allow-missing-peers" in err
    doc = json.loads((tmp_path / "out" / "results.json").read_text())
    assert "smg" in doc["sections"]["fake"]["failed"]


@pytest.mark.usefixtures("fake_section")
def test_results_folder_has_tables_plots_and_context(tmp_path: Path) -> None:
    out = tmp_path / "out"
    assert bench_run.main(["fake", "--allow-missing-peers", "--results-dir", str(out)]) == 0
    doc = json.loads((out / "results.json").read_text())
    assert len(doc["git"]["commit"]) == 40
    assert doc["machine"]["cores"] >= 1
    assert len(doc["machine"]["load_average_at_start"]) == 3
    assert set(doc["peers"]) == set(peers.PEERS)
    table = doc["sections"]["fake"]["tables"][0]
    assert table["rows"][1] == ["smg 1.13.0", "not measured"]
    png = out / table["plot"]
    assert png.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"


def test_router_bench_fails_before_starting_anything_without_smg(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    from tandem_dev.router import bench as router_bench

    monkeypatch.setattr(peers, "CACHE", tmp_path / "empty-cache")
    with pytest.raises(peers.PeerMissingError, match=r"peer smg \(1\.13\.0\) is not installed here: run `make peers`"):
        router_bench.router_cost(BenchArgs(quick=True))


@pytest.mark.netns
@pytest.mark.procs
@pytest.mark.slow
@pytest.mark.timeout(300)
def test_router_bench_quick_measures_every_target_side_by_side() -> None:
    """The router bench's quick run (wrk and smg are peers installed by ``make peers``): every target measured,
    no errors, ratios to smg computed, the TTFT rounds interleaved (the note says so), the tail at 256 connections
    with ordered percentiles."""
    from tandem_dev.router import bench as router_bench

    cost, curve, tail = router_bench.router_cost(BenchArgs(quick=True))
    rows = {row[0]: dict(zip(cost.columns, row, strict=True)) for row in cost.rows}
    names = ["direct to decode", *(name for name, _ in router_bench.ROUTERS), f"smg {peers.smg_version()}"]
    assert list(rows) == names
    for name, row in rows.items():
        rps, p50, p99 = row["req/s @32"], row["TTFT p50 ms"], row["TTFT p99 ms"]
        assert isinstance(rps, float), (name, row)
        assert isinstance(p50, float), (name, row)
        assert isinstance(p99, float), (name, row)
        assert rps > 0, (name, row)
        assert 0 < p50 <= p99, (name, row)
        assert row["errors"] == 0, (name, row)
    assert str(rows[router_bench.TANDEM]["vs smg"]).endswith("x")
    assert any(f"({router_bench.TTFT_ROUNDS} interleaved rounds)" in note for note in cost.notes)
    assert [row[0] for row in curve.rows] == [8, router_bench.COST_AT]
    tails = {row[1]: dict(zip(tail.columns, row, strict=True)) for row in tail.rows}
    assert list(tails) == [*router_bench.TAIL_TARGETS, f"smg {peers.smg_version()}"]
    for name, row in tails.items():
        assert row["connections"] == 256, (name, row)
        assert row["errors"] == 0, (name, row)
        latencies = [row[f"{p} ms"] for p in ("p50", "p90", "p99", "p99.9", "max")]
        assert all(isinstance(v, float) and v > 0 for v in latencies), (name, row)
        assert latencies == sorted(latencies), (name, row)  # type: ignore[type-var]
    assert str(tails[router_bench.TANDEM]["p99 vs ref"]).endswith("x")
    for name, row in tails.items():  # what bounds each run: the target's CPU, the machine's busy share
        cores = row["CPU cores"]
        assert (cores == "-") if name == "direct to decode" else (isinstance(cores, float) and cores > 0), (name, row)
        assert str(row["machine busy"]).endswith("%"), (name, row)
    assert tail.figure is not None


@pytest.mark.netns
@pytest.mark.procs
@pytest.mark.slow
@pytest.mark.timeout(300)
def test_streams_bench_quick_holds_paced_streams_through_every_target() -> None:
    """``tandem bench streams --quick``: 100 paced streams at once through each target, none broken, the gaps
    about the worker's pacing, the router's CPU and memory per stream measured (smg's too), direct's not."""
    from tandem_dev.router import bench_streams

    (table,) = bench_streams.run(BenchArgs(quick=True))
    rows = {row[0]: dict(zip(table.columns, row, strict=True)) for row in table.rows}
    assert list(rows) == ["direct to decode", "tandem router", f"smg {peers.smg_version()}"]
    interval_ms = bench_streams.QUICK[2] * 1000
    for name, row in rows.items():
        assert row["broken"] == 0, (name, row)
        gap = row["gap p50 ms"]
        assert isinstance(gap, float), (name, row)
        assert interval_ms / 2 < gap < interval_ms * 2, (name, row)
    for name in ("tandem router", f"smg {peers.smg_version()}"):
        cpu, kb = rows[name]["CPU us/chunk"], rows[name]["KB/stream"]
        assert isinstance(cpu, float), (name, cpu)
        assert isinstance(kb, float), (name, kb)
        assert cpu > 0, (name, cpu)
    assert rows["direct to decode"]["CPU us/chunk"] == "-"
