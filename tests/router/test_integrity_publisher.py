"""The router's integrity report in etcd (read by the operator), against a real etcd (Debian etcd-server)."""

from __future__ import annotations

import asyncio
from collections.abc import Iterator

import pytest
from prometheus_client import CollectorRegistry

from tandem import registry, registry_etcd
from tandem_dev.local_stack import start_etcd
from tandem_router.integrity.monitor import IntegrityConfig, IntegrityMonitor
from tandem_router.integrity.quarantine import QuarantinePolicy
from tandem_router.probes.members import RouterMembers
from tandem_router.probes.publisher import SHARED_PREFIX, IntegrityPublisher

pytestmark = pytest.mark.procs

PAIR = ("prefill:http://127.0.0.1:1", "decode:http://127.0.0.1:2")


@pytest.fixture(scope="module")
def etcd(tmp_path_factory: pytest.TempPathFactory) -> Iterator[str]:
    proc, endpoint = start_etcd(tmp_path_factory.mktemp("etcd"))
    yield endpoint
    proc.stop()


async def _reports(endpoint: str) -> list[registry.IntegrityReport]:
    async with registry_etcd.client([endpoint]) as etcd:
        values = await etcd.get_prefix(registry.integrity_prefix("ns", "c1").encode())
        return [registry.IntegrityReport.model_validate_json(kv.value) for kv in values]


async def _until_reports(endpoint: str, check: object, within: float = 10.0) -> list[registry.IntegrityReport]:
    deadline = asyncio.get_running_loop().time() + within
    while True:
        reports = await _reports(endpoint)
        if check(reports):  # type: ignore[operator]
            return reports
        assert asyncio.get_running_loop().time() < deadline, f"not reached; last: {reports}"
        await asyncio.sleep(0.05)


async def test_quarantine_is_published_and_cleared(etcd: str) -> None:
    monitor = IntegrityMonitor(IntegrityConfig(policy=QuarantinePolicy(threshold=1)), CollectorRegistry())
    monitor.set_pairs([PAIR], {PAIR[1]: 7})
    publisher = IntegrityPublisher(monitor, [etcd], "ns", "c1", "router-a", ttl=3, interval_s=0.05)
    stop = asyncio.Event()
    task = asyncio.create_task(publisher.run(stop))
    try:
        [empty] = await _until_reports(etcd, lambda r: len(r) == 1)
        assert empty.quarantined == ()
        monitor.failure(PAIR, "prompt_leak: output repeats another request's prompt")
        [report] = await _until_reports(etcd, lambda r: r and r[0].quarantined)
        [pair] = report.quarantined
        assert (pair.prefill, pair.decode) == ("http://127.0.0.1:1", "http://127.0.0.1:2")
        assert pair.reason.startswith(f"{SHARED_PREFIX}prompt_leak")  # a canary or shadow mismatch: shared
        assert report.quarantined_workers == ("http://127.0.0.1:1", "http://127.0.0.1:2")
        for _ in range(2):  # two failed probations: a repeat offender, reported with its epoch
            monitor.book.start_probations(float("inf"))
            monitor.comparison(PAIR, False, "mirrored answer differs")
        [report] = await _until_reports(etcd, lambda r: r and r[0].repeat_offenders)
        assert {(o.role, o.worker, o.epoch, o.quarantines) for o in report.repeat_offenders} == {
            (registry.Role.PREFILL, "http://127.0.0.1:1", 0, 3),
            (registry.Role.DECODE, "http://127.0.0.1:2", 7, 3),
        }
    finally:
        stop.set()
        await task
    assert await _reports(etcd) == []  # a router that stops removes its report at once


async def _until(check: object, within: float = 10.0) -> None:
    deadline = asyncio.get_running_loop().time() + within
    while not check():  # type: ignore[operator]
        assert asyncio.get_running_loop().time() < deadline, "not reached"
        await asyncio.sleep(0.05)


async def test_routers_see_each_other_and_the_pairs_the_others_quarantined(etcd: str) -> None:
    """``RouterMembers`` (what the canary prober splits rounds over) follows the reports: a second router appears
    when it publishes, its quarantines are the peer's, and it is gone at once when it stops."""
    monitors = {
        r: IntegrityMonitor(IntegrityConfig(policy=QuarantinePolicy(threshold=1)), CollectorRegistry()) for r in "ab"
    }
    for monitor in monitors.values():
        monitor.set_pairs([PAIR])
    members = RouterMembers("router-a", [etcd], "ns", "c2")
    members.start()
    stops = {r: asyncio.Event() for r in "ab"}
    tasks = {
        r: asyncio.create_task(
            IntegrityPublisher(monitors[r], [etcd], "ns", "c2", f"router-{r}", ttl=3, interval_s=0.05).run(stops[r])
        )
        for r in "ab"
    }
    try:
        assert members.ids() >= {"router-a"}  # itself, before any report
        await _until(lambda: members.ids() == {"router-a", "router-b"})
        assert not members.peer_quarantined()
        monitors["a"].failure(PAIR, "prompt_leak")  # its own quarantine is not a peer's
        monitors["b"].failure(PAIR, "prompt_leak")  # a canary or shadow mismatch: shared
        await _until(lambda: set(members.peer_quarantined()) == {PAIR})
        assert members.peer_quarantined()[PAIR] == {"router-b: prompt_leak"}
        stops["b"].set()
        await tasks["b"]
        await _until(lambda: members.ids() == {"router-a"} and not members.peer_quarantined())
    finally:
        stops["a"].set()
        await asyncio.gather(*tasks.values())
        await members.stop()
