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
from tandem_router.integrity_publisher import IntegrityPublisher

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
        assert pair.reason.startswith("prompt_leak")
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
