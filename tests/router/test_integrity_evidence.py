"""Detector findings as evidence (monitor level, no I/O): one client can never quarantine a pair on its own."""

from __future__ import annotations

from prometheus_client import CollectorRegistry

from tandem_router.integrity.monitor import IntegrityConfig, IntegrityMonitor
from tandem_router.integrity.quarantine import QuarantinePolicy

FOUR = [("p0", "d0"), ("p1", "d0"), ("p0", "d1"), ("p1", "d1")]
PROMPT_A = "please summarise the quarterly report of the northern mining company for the board meeting tomorrow"
FFFD = "please repeat \ufffd \ufffd \ufffd"


class Clock:
    def __init__(self) -> None:
        self.now = 0.0

    def __call__(self) -> float:
        return self.now


def _monitor(policy: QuarantinePolicy | None = None) -> tuple[IntegrityMonitor, Clock]:
    clock = Clock()
    cfg = IntegrityConfig(policy=policy or QuarantinePolicy())
    monitor = IntegrityMonitor(cfg, CollectorRegistry(), clock)
    monitor.set_pairs(FOUR)
    return monitor, clock


def _garbled(monitor: IntegrityMonitor, pair: tuple[str, str], rid: str, client: str, prompt: str = "hello") -> None:
    monitor.started(rid, prompt, client)
    assert monitor.finished(pair, rid, prompt, ["garbled \x01 text"])  # a control character not in the prompt
    monitor.released(rid)


def test_echoed_replacement_characters_are_no_finding() -> None:
    monitor, _ = _monitor()
    for i in range(5):
        monitor.started(f"r{i}", FFFD, "peer:10.0.0.9")
        assert monitor.finished(FOUR[i % 4], f"r{i}", FFFD, ["\ufffd \ufffd \ufffd"]) == []
    assert monitor.quarantined_keys() == frozenset()


def test_one_clients_findings_never_quarantine_but_ask_for_a_confirmation() -> None:
    monitor, clock = _monitor()
    for i in range(50):
        clock.now = i * 0.1
        _garbled(monitor, FOUR[i % 4], f"r{i}", "key:attacker")
    assert monitor.quarantined_keys() == frozenset()
    clock.now = 10.0
    _garbled(monitor, FOUR[0], "last", "key:attacker")
    assert monitor.take_suspect("last") == FOUR[0]
    _garbled(monitor, FOUR[0], "again", "key:attacker")
    assert monitor.take_suspect("again") is None  # one confirmation per pair per confirm_interval_s
    # The confirmation (a shadow or canary mismatch) promotes the waiting findings: the pair is out.
    monitor.failure(FOUR[0], "shadow: text differs from two other pairs")
    assert FOUR[0] in monitor.quarantined_keys()


def test_findings_of_two_independent_clients_quarantine() -> None:
    monitor, _ = _monitor()
    _garbled(monitor, FOUR[0], "a", "peer:10.0.0.1")
    assert monitor.quarantined_keys() == frozenset()
    _garbled(monitor, FOUR[0], "b", "peer:10.0.0.2")
    assert monitor.quarantined_keys() == {FOUR[0]}


def test_a_prompt_planted_by_one_client_leaking_into_others_outputs_is_one_client() -> None:
    monitor, _ = _monitor()
    monitor.started("planted", PROMPT_A, "key:attacker")
    for i, victim in enumerate(["peer:10.0.0.1", "peer:10.0.0.2", "peer:10.0.0.3"]):
        monitor.started(f"v{i}", "tell me a story", victim)
        [found] = monitor.finished(FOUR[0], f"v{i}", "tell me a story", ["once upon a time " + PROMPT_A])
        assert found.sources == {"planted"}
    assert monitor.quarantined_keys() == frozenset()  # the attacker took part in every finding


def test_detector_evidence_alone_stops_at_the_share_cap() -> None:
    monitor, _ = _monitor(QuarantinePolicy(max_detector_share=0.5))
    for n, pair in enumerate(FOUR):
        _garbled(monitor, pair, f"a{n}", "peer:10.0.0.1")
        _garbled(monitor, pair, f"b{n}", "peer:10.0.0.2")
    assert monitor.quarantined_share() == 0.5
    # Past the cap, a canary or shadow mismatch still quarantines.
    [rest] = [p for p in FOUR if p not in monitor.quarantined_keys()][:1]
    monitor.failure(rest, "canary burst answer differs")
    assert rest in monitor.quarantined_keys()


def test_a_recreated_worker_starts_clean() -> None:
    monitor, _ = _monitor(QuarantinePolicy(threshold=1))
    monitor.set_pairs(FOUR, {"d0": 1})
    monitor.failure(FOUR[0], "canary")
    assert monitor.quarantined_keys() == {FOUR[0]}
    monitor.set_pairs(FOUR, {"d0": 1})
    assert monitor.quarantined_keys() == {FOUR[0]}
    monitor.set_pairs(FOUR, {"d0": 2})  # the operator recreated the group
    assert monitor.quarantined_keys() == frozenset()


def test_a_finding_on_a_worker_a_canary_caught_elsewhere_takes_the_worker_out() -> None:
    monitor, _ = _monitor()
    monitor.failure(FOUR[0], "canary burst answer differs")  # (p0, d0): one confirmed failure, not yet out
    assert monitor.quarantined_keys() == frozenset()
    _garbled(monitor, FOUR[1], "r1", "peer:10.0.0.1")  # (p1, d0): d0 is the common factor
    assert monitor.quarantined_workers() == {"d0"}
    # p0 shares the confirmed failure, but taking (p0, d1) too would exceed the share cap on a text finding.
    _garbled(monitor, FOUR[2], "r2", "peer:10.0.0.1")
    assert monitor.quarantined_share() == 0.5
