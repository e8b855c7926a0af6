"""``tandem chaos``: its pure parts (verdicts, the fault plan, the flags), and one tiny bounded run on the local
stack whose report must keep every invariant.

The tiny run draws from every kind of fault. A prefill restarted within seconds on its old bootstrap port once
left decodes waiting 300 s for KV (README.md, "Chaos"); the local stack now restarts it on a new one.
"""

from __future__ import annotations

import asyncio
from pathlib import Path

import orjson
import pytest

from tandem_dev.chaos.cli import DEV_CLUSTER_KINDS, parse_args, run_chaos, save
from tandem_dev.chaos.report import (
    ChaosReport,
    FaultRecord,
    StreamResult,
    Verdict,
    judge,
    summary_table,
    timeline,
    violations,
)
from tandem_dev.chaos.run import ChaosArgs, plan

REF = "the sea is wide"


@pytest.mark.parametrize(
    ("result", "verdict"),
    [
        (StreamResult(0, 0.0, 1.0, first_byte=0.1, text=REF, done=True), Verdict.OK),
        (StreamResult(0, 0.0, 1.0, first_byte=0.1, text=REF + "!", done=True), Verdict.GARBLED),
        (StreamResult(0, 0.0, 1.0, first_byte=0.1, text="the sky", error="error event: x"), Verdict.GARBLED),
        (StreamResult(0, 0.0, 1.0, error="HTTP 503: b''"), Verdict.LOST),
        (StreamResult(0, 0.0, 1.0, first_byte=0.1, text="the sea", error="error event: x"), Verdict.BROKEN_ERROR),
        (StreamResult(0, 0.0, 1.0, first_byte=0.1, text="the sea", error="transport: X"), Verdict.BROKEN_CUT),
        (StreamResult(0, 0.0, 31.0, hung=True), Verdict.HUNG),
        (StreamResult(0, 0.0, 31.0, first_byte=0.1, text="the", hung=True), Verdict.HUNG),
    ],
)
def test_a_stream_is_judged_against_its_reference(result: StreamResult, verdict: Verdict) -> None:
    assert judge(result, REF) is verdict


def test_violations_name_every_broken_invariant() -> None:
    report = ChaosReport("s", {}, references={0: REF})
    assert violations(report) == ["no stream ran"]
    report.results = [
        StreamResult(0, 0.0, 1.0, first_byte=0.1, text="x", done=True),
        StreamResult(0, 0.0, 1.0, hung=True),
        StreamResult(0, 0.0, 1.0, error="HTTP 500"),
        StreamResult(0, 0.0, 1.0, first_byte=0.1, text="the sea", error="error event: not resumed"),
        StreamResult(0, 0.0, 1.0, first_byte=0.1, text="the sea", error="transport: ServerDisconnectedError"),
        StreamResult(0, 0.0, 2.5, first_byte=0.1, text=REF, done=True),
    ]
    report.faults = [FaultRecord("etcd", "etcd-1", 1.0, note="no answer")]
    assert violations(report) == [
        "1 lost before first byte",
        "1 broken after first byte: error event",
        "1 broken after first byte: connection cut",
        "1 hung",
        "1 garbled",
        "etcd etcd-1 not recovered (no answer)",
    ]
    assert timeline(report) == [(0.0, 0, 0), (1.0, 0, 5), (2.0, 1, 0)]


def test_only_streams_cut_on_their_killed_router_are_exempt_and_counted_apart() -> None:
    def cut(started: float, ended: float, router: int) -> StreamResult:
        return StreamResult(0, started, ended, 0.1, "the sea", error="transport: X", router=router)

    report = ChaosReport("s", {}, references={0: REF}, faults=[FaultRecord("router", "router-1", 5.0, recovered=2.0)])
    report.results = [
        cut(4.0, 5.1, router=1),  # on router-1, in flight at its kill: exempt
        StreamResult(0, 4.9, 5.0, router=1, error="stream ended without [DONE]"),  # before its first byte: exempt
        cut(4.0, 5.1, router=0),  # on the other router: a violation
        cut(5.2, 6.0, router=1),  # started after the kill (the new router cut it): a violation
        StreamResult(0, 4.0, 5.1, router=1, error="HTTP 503: b''"),  # an answer, not a cut: a violation
        StreamResult(0, 4.0, 5.1, router=1, first_byte=0.1, text="the sea", error="error event: x"),  # a violation
        StreamResult(0, 4.0, 5.1, router=1, first_byte=0.1, text="the sky", error="transport: X"),  # garbled
    ]
    assert report.verdicts()[:2] == [Verdict.ROUTER_KILLED] * 2
    assert report.counts()[Verdict.ROUTER_KILLED] == 2
    assert violations(report) == [
        "1 lost before first byte",
        "1 broken after first byte: error event",
        "2 broken after first byte: connection cut",
        "1 garbled",
    ]
    assert ["cut on its killed router (exempt)", 2] in summary_table(report).rows


def test_the_plan_covers_every_kind_before_repeating_and_is_seeded() -> None:
    args = ChaosArgs(faults=7, duration_s=100.0, seed=3)
    first = plan(args)
    assert first == plan(args) != plan(ChaosArgs(faults=7, duration_s=100.0, seed=4))
    assert sorted(kind for _, kind in first[: len(args.kinds)]) == sorted(args.kinds)
    assert all(10.0 <= at <= 75.0 for at, _ in first)
    assert [at for at, _ in first] == sorted(at for at, _ in first)


@pytest.mark.parametrize(
    ("argv", "message"),
    [
        (["--kinds", "decode,meteor"], "--kinds: unknown kind(s) ['meteor']"),
        (["--kinds", "operator"], "--kinds: unknown kind(s) ['operator'] for --setting local"),
        (["--setting", "moon"], "--setting: invalid choice: 'moon'"),
        (["--concurrency", "0"], "--concurrency must be at least 1"),
        (["--duration", "0"], "--duration must be positive"),
    ],
)
def test_bad_flags_are_refused_naming_the_flag(
    argv: list[str], message: str, capsys: pytest.CaptureFixture[str]
) -> None:
    with pytest.raises(SystemExit):
        parse_args(argv)
    assert message in capsys.readouterr().err


def test_the_dev_cluster_setting_adds_the_operator_leader_kill() -> None:
    local, _ = parse_args([])
    dev, _ = parse_args(["--setting", "dev-cluster"])
    assert "operator" not in local.kinds
    assert dev.kinds == DEV_CLUSTER_KINDS
    assert dev.knobs()["setting"] == "dev-cluster"
    assert parse_args(["--setting", "dev-cluster", "--kinds", "operator,decode"])[0].kinds == ("operator", "decode")


@pytest.mark.netns
@pytest.mark.procs
@pytest.mark.slow
@pytest.mark.timeout(420)
def test_a_tiny_chaos_run_keeps_every_invariant(tmp_path: Path) -> None:
    kinds = ("prefill", "decode", "router", "etcd", "transfer")
    args = ChaosArgs(concurrency=4, duration_s=25.0, faults=5, kinds=kinds, max_tokens=60, prompts=6, seed=1)
    report = asyncio.run(run_chaos(args, tmp_path / "logs"))
    counts = report.counts()
    print(dict(counts), report.router_counters, report.faults)
    # Every stream ends equal to its reference, resumed where its decode died, but those cut on their killed
    # router: no stream can move across routers, and at most `concurrency` are in flight on one at its kill.
    assert violations(report) == []
    assert counts[Verdict.OK] > 0
    router_kills = sum(f.kind == "router" for f in report.faults)
    assert counts[Verdict.ROUTER_KILLED] <= args.concurrency * router_kills
    assert len(report.faults) >= 3
    assert {f.kind for f in report.faults} <= set(kinds)
    for fault in report.faults:
        if fault.kind == "decode":
            assert fault.fenced is not None
            assert fault.recovered is not None
            assert fault.fenced <= fault.recovered
    saved = orjson.loads(save(report, tmp_path / "out", ["--seed", "1"]).read_bytes())
    assert saved["violations"] == []
    titles = [t["title"] for t in saved["sections"]["chaos"]["tables"]]
    assert titles[0].startswith("chaos (local stack")
    assert titles[1].startswith("chaos faults")
    assert (tmp_path / "out" / "timeline.png").stat().st_size > 1000
    assert (tmp_path / "out" / "recovery.png").stat().st_size > 1000
