"""Scoring rules of canary rounds (the network part, ``probe``, is replaced by fixed answers here; the end-to-end
integrity tests run real canaries through simulated workers)."""

from __future__ import annotations

from prometheus_client import CollectorRegistry

from tandem.registry import Role
from tandem_router.integrity.divergence import Answer
from tandem_router.integrity.monitor import IntegrityConfig, IntegrityMonitor
from tandem_router.integrity.probe_budget import ProbeBudget, ProbeMetrics
from tandem_router.integrity.probe_plan import ROTATION_BESIDE_BURSTS
from tandem_router.integrity.quarantine import QuarantinePolicy
from tandem_router.pool import Pair, WorkerSpec
from tandem_router.probes.canary import CanaryProber, ProbeScope
from tandem_router.probes.race import RaceProber
from tandem_router.transport import Transport
from tests.router.helpers import ample_budget, lone_router

P = WorkerSpec(Role.PREFILL, "http://p0:1", 8998)
DECODES = [WorkerSpec(Role.DECODE, f"http://d{i}:2") for i in range(3)]
PAIRS = [Pair(P, d) for d in DECODES]


class FixedAnswers(CanaryProber):
    def __init__(self, monitor: IntegrityMonitor, answers: dict[str, str]) -> None:
        super().__init__(monitor, Transport(), lambda: PAIRS, ample_budget(monitor), lone_router())
        self.answers = answers

    async def probe(self, pair: Pair, prompt: str) -> Answer | None:
        text = self.answers.get(pair.decode.url)
        return None if text is None else Answer(text)


def _monitor() -> IntegrityMonitor:
    return IntegrityMonitor(
        IntegrityConfig(policy=QuarantinePolicy(threshold=1, probe_initial_s=60)), CollectorRegistry()
    )


async def test_minority_answer_fails_and_quarantines_the_pair() -> None:
    monitor = _monitor()
    prober = FixedAnswers(monitor, {"http://d0:2": "good", "http://d1:2": "good", "http://d2:2": "garbled"})
    await prober.round()
    assert monitor.quarantined_keys() == {PAIRS[2].key}
    assert prober.references  # the majority answer became the reference


async def test_clean_round_answers_do_not_release_a_quarantined_pair() -> None:
    monitor = _monitor()
    monitor.failure(PAIRS[2].key, "prompt_leak")
    prober = FixedAnswers(monitor, {d.url: "good" for d in DECODES})
    for _ in range(5):
        await prober.round()
    assert monitor.quarantined_keys() == {PAIRS[2].key}  # only the scheduled burst re-probes can release it


async def test_no_majority_blames_nobody() -> None:
    monitor = _monitor()
    prober = FixedAnswers(monitor, {"http://d0:2": "a", "http://d1:2": "b", "http://d2:2": "c"})
    await prober.round()
    assert monitor.quarantined_keys() == frozenset()


FLEET_P = [WorkerSpec(Role.PREFILL, f"http://p{i}:1", 8998) for i in range(8)]
FLEET_D = [WorkerSpec(Role.DECODE, f"http://d{i}:2") for i in range(8)]
FLEET = [Pair(p, d) for p in FLEET_P for d in FLEET_D]


class Recorded(CanaryProber):
    """Every probe answers the same; the pairs probed are recorded."""

    def __init__(self, monitor: IntegrityMonitor, scope: ProbeScope, budget: ProbeBudget | None = None) -> None:
        super().__init__(monitor, Transport(), lambda: FLEET, budget or ample_budget(monitor), scope)
        self.wall_clock = lambda: 3000.0  # round 100 for every prober
        self.probed: list[tuple[str, str]] = []

    async def probe(self, pair: Pair, prompt: str) -> Answer | None:
        self.probed.append(pair.key)
        return Answer("good")


def _scope(me: str, routers: set[str], first: frozenset[tuple[str, str]] = frozenset()) -> ProbeScope:
    return ProbeScope(me, lambda: routers, lambda pair: pair in first)


async def test_a_round_probes_each_worker_through_two_partners_not_every_pair() -> None:
    prober = Recorded(_monitor(), _scope("a", {"a"}))
    await prober.round()
    assert len(prober.probed) == 16  # 2 x max(P, D), not P x D = 64
    for worker in (*FLEET_P, *FLEET_D):
        assert sum(worker.key in pair for pair in prober.probed) >= 2


async def test_beside_race_bursts_a_round_probes_suspects_and_a_window_of_the_rotation() -> None:
    monitor = _monitor()
    suspect = FLEET[8 * 1 + 5].key
    prober = Recorded(monitor, _scope("a", {"a"}, frozenset({suspect})))
    prober.race = RaceProber(monitor, Transport(), lambda: FLEET, prober.budget, "a", lambda: {"a"})
    await prober.round()
    assert prober.probed[0] == suspect
    assert len(prober.probed) == 1 + ROTATION_BESIDE_BURSTS  # not 16: the bursts sweep every decode


async def test_routers_of_a_cluster_split_a_round() -> None:
    routers = {"a", "b", "c", "d"}
    probers = [Recorded(_monitor(), _scope(me, routers), None) for me in sorted(routers)]
    for prober in probers:
        await prober.round()
    together = [pair for prober in probers for pair in prober.probed]
    assert len(together) == len(set(together)) == 16


async def test_suspects_and_new_workers_go_first_and_the_budget_cuts_the_rest() -> None:
    monitor = _monitor()
    suspect = FLEET[8 * 1 + 5].key  # (p1, d5): round 100's rotation gives d5 p(5+200)%8 = p5 and p6, not p1
    budget = ProbeBudget(0.01, lambda: 400.0, ProbeMetrics(monitor.metrics.registry), clock=lambda: 0.0)
    budget.expected_s = 60.0  # 4 request-seconds a second, 60 s deep: 4 probes of 60 s
    prober = Recorded(monitor, _scope("a", {"a"}, frozenset({suspect})), budget)
    await prober.round()
    assert prober.probed[0] == suspect
    assert len(prober.probed) == 4
    denied = monitor.metrics.registry.get_sample_value("tandem_integrity_probes_denied_total", {"kind": "canary"})
    assert denied == 13


async def test_a_pair_another_router_quarantined_is_suspected_and_confirmed_here_not_quarantined() -> None:
    monitor = _monitor()
    peer_out = FLEET[3].key
    scope = ProbeScope("a", lambda: {"a", "b"}, lambda pair: False, lambda: {peer_out})
    prober = Recorded(monitor, scope)
    await prober.round()  # a reference to burst with
    prober.probed.clear()
    prober.confirm_peer_quarantines()
    await prober.drain()
    assert monitor.under_suspicion(peer_out)  # its deterministic answers are compared here now
    assert set(prober.probed) == {peer_out}  # and a confirmation burst went through it
    assert monitor.quarantined_keys() == frozenset()  # its answers were clean here: nothing on the peer's word
    prober.probed.clear()
    prober.confirm_peer_quarantines()
    await prober.drain()
    assert prober.probed == []  # at most once per PEER_CONFIRM_S
