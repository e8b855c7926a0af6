"""``tandem.leased_writer`` against a real etcd (Debian etcd-server) that is frozen, killed and restarted.

A frozen etcd (SIGSTOP, as a hung disk looks) revokes every lease whose TTL passed as soon as it runs again, and
their keys go with them: the writer must put its keys back under a new lease within a couple of seconds of etcd
answering, without bringing back a key it deleted.
"""

from __future__ import annotations

import asyncio
import os
import signal
import time
from collections.abc import AsyncIterator, Callable, Iterator
from pathlib import Path
from typing import Any

import pytest

from tandem.etcd_errors import EtcdError, LeaseNotFoundError
from tandem.leased_writer import LeasedWriter
from tandem.registry_etcd import client, close_client
from tandem_dev.local_stack import start_etcd
from tandem_dev.procs import ManagedProcess

pytestmark = [pytest.mark.procs, pytest.mark.timeout(60)]

WANT = {f"t/k{i}".encode(): f"v{i}".encode() for i in range(3)}


@pytest.fixture
def etcd(tmp_path: Path) -> Iterator[tuple[ManagedProcess, str]]:
    """An etcd of the test's own (frozen or killed by it): the process and its ``host:port``."""
    proc, endpoint = start_etcd(tmp_path)
    yield proc, endpoint
    if proc.alive():
        os.kill(proc.pid, signal.SIGCONT)  # a test that failed while it was frozen
    proc.stop()


@pytest.fixture
async def reader(etcd: tuple[ManagedProcess, str]) -> AsyncIterator[Any]:
    etcd_client = client([etcd[1]])
    yield etcd_client
    await close_client(etcd_client)


async def _entries(reader: Any) -> dict[bytes, tuple[bytes, int]] | None:
    try:
        async with asyncio.timeout(1):
            return {kv.key: (kv.value, kv.lease) for kv in await reader.get_prefix(b"t/")}
    except (TimeoutError, EtcdError):
        return None  # etcd not answering (yet)


async def _until_back(reader: Any, want: dict[bytes, bytes], lease_ok: Callable[[int], bool], within: float) -> float:
    """Seconds until etcd holds exactly ``want`` under ``t/``, every key under a lease ``lease_ok`` accepts."""
    started = time.monotonic()
    while True:
        entries = await _entries(reader)
        values = None if entries is None else {k: v for k, (v, _) in entries.items()}
        if entries is not None and values == want and all(lease_ok(lease) for _, lease in entries.values()):
            return time.monotonic() - started
        assert time.monotonic() - started < within, f"keys not back within {within}s: {entries}"
        await asyncio.sleep(0.02)


async def _advertised(endpoint: str, ttl: int) -> LeasedWriter:
    writer = LeasedWriter([endpoint], ttl=ttl)
    await writer.start()
    for key, value in WANT.items():
        await writer.put(key, value)
    return writer


async def test_keys_come_back_under_a_new_lease_after_etcd_was_frozen_past_the_ttl(
    etcd: tuple[ManagedProcess, str], reader: Any
) -> None:
    proc, endpoint = etcd
    writer = await _advertised(endpoint, ttl=2)
    lost = asyncio.Event()

    async def on_lost() -> None:
        lost.set()

    writer.on_lease_lost(on_lost)
    try:
        await writer.put(b"t/fenced", b"x")  # deleted during normal operation: must stay deleted
        assert await writer.delete(b"t/fenced")
        old = writer.lease_id
        os.kill(proc.pid, signal.SIGSTOP)
        try:
            await asyncio.sleep(5)  # 2.5 TTLs frozen
        finally:
            os.kill(proc.pid, signal.SIGCONT)
        took = await _until_back(reader, WANT, lambda lease: lease == writer.lease_id != old, within=2)
        print(f"keys back {took:.2f} s after the thaw")
        await asyncio.wait_for(lost.wait(), 2)
        assert writer.lease_grants == 2
        assert writer.advertised == WANT
    finally:
        await writer.close(revoke=True)
    assert await _entries(reader) == {}


async def test_keys_are_there_after_etcd_was_killed_and_restarted_past_the_ttl(
    etcd: tuple[ManagedProcess, str], reader: Any
) -> None:
    proc, endpoint = etcd
    writer = await _advertised(endpoint, ttl=2)
    try:
        proc.signal(signal.SIGKILL)
        await asyncio.sleep(3)  # down past the TTL
        await asyncio.to_thread(proc.stop)
        proc.start()
        await asyncio.to_thread(proc.wait_http, f"http://{endpoint}/health", 30)
        # etcd gives every lease a fresh TTL when it becomes leader again: the keys never went; if they had, the
        # writer would re-advertise them under a new lease. Either way: every key there, under the writer's lease.
        took = await _until_back(reader, WANT, lambda lease: lease == writer.lease_id, within=2)
        print(f"keys there {took:.2f} s after etcd answered /health again; lease grants: {writer.lease_grants}")
        deadline = time.monotonic() + 2
        while writer.outage_since is not None:  # the keep-alive refreshes again
            assert time.monotonic() < deadline, "the writer never saw etcd answer again"
            await asyncio.sleep(0.02)
    finally:
        await writer.close(revoke=True)


async def test_a_put_under_a_lease_etcd_no_longer_has_brings_every_key_back_at_once(
    etcd: tuple[ManagedProcess, str], reader: Any
) -> None:
    """With a 30 s TTL the next refresh is 10 s away: the failed put itself has the lease replaced."""
    writer = await _advertised(etcd[1], ttl=30)
    try:
        old = writer.lease_id
        await reader.revoke_lease(old)
        with pytest.raises(LeaseNotFoundError, match=r"^etcd put at .*lease not found"):
            await writer.put(b"t/k3", b"v3")
        want = {**WANT, b"t/k3": b"v3"}  # the failed put's key too: it was advertised
        await _until_back(reader, want, lambda lease: lease == writer.lease_id != old, within=2)
    finally:
        await writer.close(revoke=True)


async def test_a_put_that_failed_while_etcd_was_down_lands_once_etcd_answers(
    etcd: tuple[ManagedProcess, str], reader: Any
) -> None:
    proc, endpoint = etcd
    writer = await _advertised(endpoint, ttl=30)  # a lease that outlives the outage: only the failed put is missing
    try:
        proc.signal(signal.SIGKILL)
        await asyncio.to_thread(proc.stop)
        with pytest.raises((TimeoutError, EtcdError)):  # never reached etcd (a frozen one may apply it later)
            async with asyncio.timeout(2):  # a caller that gives up (the local stack registering a restart)
                await writer.put(b"t/late", b"v-late")
        proc.start()  # the same ports and data
        took = await _until_back(reader, {**WANT, b"t/late": b"v-late"}, lambda lease: lease == writer.lease_id, 10)
        print(f"\na put that failed while etcd was down landed {took:.2f} s after etcd was started again")
        assert writer.lease_grants == 1  # the same lease (etcd keeps it over a restart): only the put was missing
    finally:
        await writer.close(revoke=True)
