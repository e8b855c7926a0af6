"""Probation mirroring: how much load a pair on probation gets, and how its answers decide (fake workers)."""

from __future__ import annotations

import asyncio
from collections import Counter
from typing import Any

import orjson
from prometheus_client import CollectorRegistry

from tandem.registry import Role
from tandem_router.dispatch import ProxyRequest
from tandem_router.integrity.monitor import IntegrityConfig, IntegrityMonitor
from tandem_router.integrity.quarantine import QuarantinePolicy
from tandem_router.openai.requests import ParsedRequest
from tandem_router.openai.schema import Route
from tandem_router.pool import Pair, WorkerPool, WorkerSpec
from tandem_router.probes.probation import ProbationMirror, load_target, mirror_targets
from tandem_router.transport import Request, Transport

P = [WorkerSpec(Role.PREFILL, f"http://p{i}:1", 8998) for i in range(2)]
D = [WorkerSpec(Role.DECODE, f"http://d{i}:2") for i in range(2)]


def _pool_with_bad_decode(on_probation: int) -> tuple[WorkerPool, IntegrityMonitor]:
    """48 client requests in flight on d0; d1's pairs quarantined, ``on_probation`` of them on probation."""
    monitor = IntegrityMonitor(IntegrityConfig(policy=QuarantinePolicy(threshold=1)), CollectorRegistry())
    pool = WorkerPool(gates=[monitor])
    for spec in (*P, *D):
        pool.upsert(spec)
    pool.workers[D[0].key].in_flight = 48
    bad = [(p.key, D[1].key) for p in P]
    monitor.set_pairs([(p.key, d.key) for p in P for d in D])
    for pair in bad:
        monitor.failure(pair, "canary")
    monitor.book.start_probations(float("inf"))  # both pairs of d1 on probation
    for pair in bad[on_probation:]:
        monitor.book.record_comparison(pair, False, float("inf"), "mismatch")  # back to quarantine
    return pool, monitor


def test_a_decode_on_probation_carries_what_a_serving_decode_carries() -> None:
    pool, monitor = _pool_with_bad_decode(on_probation=2)
    targets = mirror_targets(pool, monitor, set(monitor.probation_pairs()))
    assert sorted(targets.values()) == [24, 24]  # 48 on d1 in all, like d0
    pool, monitor = _pool_with_bad_decode(on_probation=1)
    [(pair, target)] = mirror_targets(pool, monitor, set(monitor.probation_pairs())).items()
    assert target == 48  # its other pair is back in quarantine: this one carries the decode's whole share
    assert load_target(pool, monitor, pair) == 48
    assert load_target(pool, monitor, (P[0].key, D[0].key)) == 24  # a serving pair's share


class _Answer:
    def __init__(self, text: str) -> None:
        self.status = 200
        self.body = orjson.dumps({"text": text})

    async def __aenter__(self) -> _Answer:
        return self

    async def __aexit__(self, *_: object) -> None:
        return None

    async def read(self) -> bytes:
        return self.body


class FakeWorkers(Transport):
    """Decodes answer a fixed text per URL after a short delay; prefills answer empty. Counts decode requests."""

    def __init__(self, texts: dict[str, str]) -> None:
        super().__init__()
        self.texts = texts
        self.sent: Counter[str] = Counter()

    async def open(self, base_url: str, request: Request) -> Any:
        await asyncio.sleep(0.001)
        self.sent[base_url] += 1
        return _Answer(self.texts.get(base_url, ""))


def _request(i: int) -> ProxyRequest:
    body = {"text": f"prompt {i}", "sampling_params": {"temperature": 0, "max_new_tokens": 8}}
    return ProxyRequest(ParsedRequest.of(Route.GENERATE, body), "p", f"r{i}", 0.0, f"prompt {i}")


async def _probation_run(decodes: int, bad_text: str) -> tuple[IntegrityMonitor, FakeWorkers]:
    """One prefill; d0 garbles or not (``bad_text``), the other decodes answer "good". d0's pair on probation;
    live answers from d1 are mirrored to it until it is released or sent back."""
    specs = [WorkerSpec(Role.DECODE, f"http://d{i}:2") for i in range(decodes)]
    monitor = IntegrityMonitor(
        IntegrityConfig(policy=QuarantinePolicy(threshold=1, comparisons_to_release=20)), CollectorRegistry()
    )
    pool = WorkerPool(gates=[monitor])
    for spec in (P[0], *specs):
        pool.upsert(spec)
    monitor.set_pairs([(P[0].key, d.key) for d in specs])
    suspect = (P[0].key, specs[0].key)
    monitor.failure(suspect, "canary")
    monitor.book.start_probations(float("inf"))
    workers = FakeWorkers({specs[0].url: bad_text, **{d.url: "good" for d in specs[1:]}})
    mirror = ProbationMirror(monitor, workers, pool)
    trusted = Pair(P[0], specs[1])
    for i in range(10):
        mirror.completed(trusted, _request(i), ["good"])
        await asyncio.sleep(0.01)
        if not monitor.book.in_probation(suspect):
            break
    await asyncio.sleep(0.2)
    await mirror.drain()
    return monitor, workers


async def test_a_clean_pair_on_probation_is_released_by_the_closed_loop() -> None:
    monitor, workers = await _probation_run(decodes=2, bad_text="good")
    assert monitor.quarantined_keys() == frozenset()
    assert workers.sent["http://d0:2"] >= 20  # replayed beyond the 10 live answers


async def test_a_garbling_pair_on_probation_is_sent_back_when_a_third_pair_confirms() -> None:
    monitor, _ = await _probation_run(decodes=3, bad_text="garbled")
    [view] = monitor.quarantined()
    assert not view.probation
    assert view.reason.startswith("failed on probation: mirrored answer differs from two trusted pairs")


async def test_without_a_third_pair_a_mismatch_is_never_proven_clean() -> None:
    monitor, workers = await _probation_run(decodes=2, bad_text="garbled")
    [view] = monitor.quarantined()
    assert view.probation  # not proven bad ...
    assert view.clean_comparisons == 0  # ... nor clean: never released
    assert workers.sent["http://d0:2"] > 0
