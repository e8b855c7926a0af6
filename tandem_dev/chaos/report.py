"""What a chaos run measured, as data: each stream's outcome judged against the uninterrupted reference, each
fault's fence and recovery times, the tables ``tandem chaos`` prints and the invariants its test asserts.

The promise a run checks: every stream the user started ends equal to its reference. A stream that failed or
was cut and was not resumed is a violation, before or after its first byte; the one exemption is a stream whose
own router was killed while it was in flight (no router can resume a stream across routers: the client sees its
connection close), counted and shown apart.

Pure: no I/O, no clocks. Times are seconds since the run's start.
"""

from __future__ import annotations

import enum
from collections import Counter
from collections.abc import Sequence
from dataclasses import dataclass, field

from tandem_dev.bench import Table


class Verdict(enum.StrEnum):
    OK = "ok"  # complete, equal to the reference
    LOST = "lost before first byte"  # an error status, or the connection went, before any event
    BROKEN_ERROR = "broken after first byte: error event"  # the router ended the stream with an OpenAI error
    BROKEN_CUT = "broken after first byte: connection cut"  # the stream ended without [DONE], not resumed
    HUNG = "hung"  # no event for the hang timeout: the client gave up
    GARBLED = "garbled"  # text that is not the reference (or, when broken, not a prefix of it)
    # Lost or cut (no error status, no error event) on a router killed while the stream was in flight: exempt.
    ROUTER_KILLED = "cut on its killed router (exempt)"


@dataclass
class StreamResult:
    """What one client saw: ``text`` as relayed, ``done`` when ``[DONE]`` arrived."""

    prompt: int
    started: float
    ended: float
    first_byte: float | None = None
    text: str = ""
    done: bool = False
    error: str = ""  # an error event's message, or the HTTP status / transport error
    hung: bool = False
    failovers: int = 0  # attempts moved to another router because the first refused the connection
    router: int | None = None  # index of the router its last attempt went to (``router-<index>`` in faults)


def judge(result: StreamResult, reference: str) -> Verdict:
    """A stream's verdict. Garbled wins over every other: a wrong byte is worse than a missing one."""
    if result.done:
        return Verdict.OK if result.text == reference and not result.error else Verdict.GARBLED
    if not reference.startswith(result.text):
        return Verdict.GARBLED
    if result.hung:
        return Verdict.HUNG
    if result.first_byte is None:
        return Verdict.LOST
    return Verdict.BROKEN_ERROR if result.error.startswith("error event") else Verdict.BROKEN_CUT


@dataclass
class FaultRecord:
    """One injected fault. ``fenced`` / ``recovered``: seconds from injection (``None``: not within the cap, or
    not applicable: see ``note``)."""

    kind: str
    victim: str
    at: float
    fenced: float | None = None
    recovered: float | None = None
    note: str = ""


@dataclass
class ChaosReport:
    setting: str
    knobs: dict[str, object]
    results: list[StreamResult] = field(default_factory=list)
    references: dict[int, str] = field(default_factory=dict)
    faults: list[FaultRecord] = field(default_factory=list)
    router_counters: dict[str, float] = field(default_factory=dict)  # resumed, retries, stream errors (all routers)
    seconds: float = 0.0

    def verdicts(self) -> list[Verdict]:
        kills = [(int(f.victim.rsplit("-", 1)[1]), f.at) for f in self.faults if f.kind == "router"]
        return [_exempt(r, judge(r, self.references[r.prompt]), kills) for r in self.results]

    def counts(self) -> Counter[Verdict]:
        return Counter(self.verdicts())


def _exempt(result: StreamResult, verdict: Verdict, kills: list[tuple[int, float]]) -> Verdict:
    """``ROUTER_KILLED`` for a stream lost or cut by its own router's death: it went to a router that was killed
    while it was in flight (``at`` is taken before the kill, which no other task can run between) and ended
    without an error status (an HTTP error is an answer, not a cut)."""
    cut = verdict is Verdict.BROKEN_CUT or (verdict is Verdict.LOST and not result.error.startswith("HTTP"))
    on_killed = any(result.router == i and result.started <= at <= result.ended for i, at in kills)
    return Verdict.ROUTER_KILLED if cut and on_killed else verdict


def violations(report: ChaosReport) -> list[str]:
    """The run's broken promises: every stream that did not end equal to its reference (garbled, hung, lost
    before its first byte, ended by an error event or cut after it) but those cut on their killed router, a fault
    that was never recovered, or a run with no traffic."""
    counts = report.counts()
    out = []
    if not report.results:
        out.append("no stream ran")
    out += [f"{counts[v]} {v.value}" for v in Verdict if v not in (Verdict.OK, Verdict.ROUTER_KILLED) and counts[v]]
    out += [f"{f.kind} {f.victim} not recovered ({f.note})" for f in report.faults if f.recovered is None]
    return out


def _pct(values: Sequence[float], q: float) -> float | str:
    if not values:
        return "-"
    s = sorted(values)
    return s[min(len(s) - 1, int(len(s) * q))]


def summary_table(report: ChaosReport) -> Table:
    counts = report.counts()
    k = report.knobs
    rows: list[Sequence[object]] = [["streams", len(report.results)]]
    rows += [[v.value, counts[v]] for v in Verdict]
    rows += [["client failovers to the other router", sum(r.failovers for r in report.results)]]
    rows += [[f"router: {name}", value] for name, value in sorted(report.router_counters.items())]
    fenced = [f.fenced for f in report.faults if f.fenced is not None]
    recovered = [f.recovered for f in report.faults if f.recovered is not None]
    rows += [
        ["faults injected", len(report.faults)],
        ["time to fence p50 / max s", f"{_fmt(_pct(fenced, 0.5))} / {_fmt(max(fenced, default='-'))}"],
        ["time to recover p50 / max s", f"{_fmt(_pct(recovered, 0.5))} / {_fmt(max(recovered, default='-'))}"],
    ]
    return Table(
        f"chaos ({report.setting}): {len(report.results)} streams at concurrency {k.get('concurrency')}, "
        f"{len(report.faults)} faults, seed {k.get('seed')}",
        ["outcome", "count"],
        rows,
        notes=[f"knobs: {', '.join(f'{name}={value}' for name, value in k.items())}"],
    )


def faults_table(report: ChaosReport) -> Table:
    rows: list[Sequence[object]] = [
        [f.kind, f.victim, round(f.at, 1), _fmt(f.fenced), _fmt(f.recovered), f.note] for f in report.faults
    ]
    return Table(
        "chaos faults: seconds from injection to fenced (no traffic to it from any router) and to recovered",
        ["fault", "victim", "at s", "fenced s", "recovered s", "how measured"],
        rows,
    )


def _fmt(value: float | str | None) -> str:
    if value is None:
        return "-"
    return f"{value:.2f}" if isinstance(value, float) else str(value)


def timeline(report: ChaosReport, bucket_s: float = 1.0) -> list[tuple[float, int, int]]:
    """(bucket start, streams completed OK, streams that ended otherwise) per ``bucket_s`` of the run."""
    verdicts = report.verdicts()
    end = max((r.ended for r in report.results), default=0.0)
    buckets = [[i * bucket_s, 0, 0] for i in range(int(end // bucket_s) + 1)]
    for r, verdict in zip(report.results, verdicts, strict=True):
        slot = buckets[int(r.ended // bucket_s)]
        slot[1 if verdict is Verdict.OK else 2] += 1
    return [(float(t), int(ok), int(bad)) for t, ok, bad in buckets]
