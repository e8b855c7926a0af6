"""Scoring rules of race bursts (``probes/race.py``; the network part, ``probe``, is replaced by answers that model
a racing decode: an answer garbles when another probe reached the decode while it decoded)."""

from __future__ import annotations

import asyncio
import time

from prometheus_client import CollectorRegistry

from tandem.registry import Role
from tandem_router.integrity.divergence import Answer
from tandem_router.integrity.monitor import IntegrityConfig, IntegrityMonitor
from tandem_router.pool import Pair, WorkerSpec
from tandem_router.probes.race import RaceProber
from tandem_router.transport import Transport
from tests.router.helpers import ample_budget

PREFILLS = [WorkerSpec(Role.PREFILL, f"http://p{i}:1", 8998) for i in range(4)]
DECODES = [WorkerSpec(Role.DECODE, f"http://d{i}:2") for i in range(4)]
PAIRS = [Pair(p, d) for p in PREFILLS for d in DECODES]
RACING = "http://d3:2"
FIRST_TOKEN_S = 0.005  # a probe's first token, which sets its offload off
DECODE_S = 0.03  # a probe's time on the decode


class ModelledDecodes(RaceProber):
    """Clean decodes answer a prompt alike; the racing one garbles an answer when a later probe arrives while it
    decodes (the stagger puts them there)."""

    def __init__(self, monitor: IntegrityMonitor) -> None:
        super().__init__(monitor, Transport(), lambda: PAIRS, ample_budget(monitor), "r0", lambda: {"r0"}, 0.0)
        self.running: dict[str, list[list[float]]] = {}
        self.pairs_probed: list[tuple[str, str]] = []

    async def probe(self, pair: Pair, prompt: str) -> Answer | None:
        self.pairs_probed.append(pair.key)
        now = time.monotonic()
        mine = [now, False]
        others = self.running.setdefault(pair.decode.url, [])
        if pair.decode.url == RACING:
            for other in others:  # this newcomer takes the pages an earlier probe handed back at its first token
                other[1] = other[1] or now - other[0] >= FIRST_TOKEN_S
        others.append(mine)
        await asyncio.sleep(DECODE_S)
        others.remove(mine)
        return Answer(f"{prompt[-10:]} garbled" if mine[1] else f"{prompt[-10:]} clean")


def _monitor() -> IntegrityMonitor:
    return IntegrityMonitor(IntegrityConfig(), CollectorRegistry())


async def _sweep(prober: ModelledDecodes) -> None:
    for _ in range(20):
        await prober.step()
    await prober.drain()


async def test_one_burst_convicts_a_racing_decode_and_clean_decodes_pass() -> None:
    monitor = _monitor()
    prober = ModelledDecodes(monitor)
    prober._times.append(DECODE_S)  # the stagger: 10 ms, after a probe's first token and before its last
    await _sweep(prober)
    assert len(prober.references) == len(prober.prompts)  # learned through three distinct decodes at once
    assert all(a.text.endswith("clean") for a in prober.references.values())
    assert monitor.quarantined_keys() == {p.key for p in PAIRS if p.decode.url == RACING}  # convicted: all its pairs


async def test_bursts_sent_all_at_once_find_nothing_so_the_stagger_matters() -> None:
    monitor = _monitor()
    prober = ModelledDecodes(monitor)
    prober._times.append(0.0)  # no stagger: the probes arrive together and none reads another's pages late
    await _sweep(prober)
    assert monitor.quarantined_keys() == frozenset()


async def test_a_burst_goes_through_distinct_prefills_of_one_decode() -> None:
    monitor = _monitor()
    prober = ModelledDecodes(monitor)
    prober.references = {p: Answer(f"{p[-10:]} clean") for p in prober.prompts}
    await prober.step()
    await prober.drain()
    decodes = {d for _, d in prober.pairs_probed}
    prefills = [p for p, _ in prober.pairs_probed]
    assert len(decodes) == 1
    assert len(set(prefills)) == len(prefills) == 3
