"""``tandem up``'s supervisor starts a killed etcd member again, on its ports and data, and the workers' registry
keys are there under the stack's lease afterwards (instant workers, plaintext etcd)."""

from __future__ import annotations

import asyncio
import signal
import time
from collections.abc import Callable
from pathlib import Path

import pytest

from tandem import registry
from tandem.etcd_errors import EtcdError
from tandem.registry_etcd import client, close_client
from tandem_dev.local_stack import CLUSTER, NAMESPACE, LocalStack, instant_worker_argv
from tandem_dev.stack_fixture import running_stack

pytestmark = [pytest.mark.procs, pytest.mark.timeout(90)]


def test_supervisor_restarts_a_killed_etcd_and_the_workers_keys_are_there(tmp_path: Path) -> None:
    with running_stack(
        tmp_path,
        router_port=0,
        worker_argv=instant_worker_argv,
        prefills=1,
        decodes=1,
        restart=False,
        secure=False,
        lease_ttl=2,
    ) as stack:
        asyncio.run(_kill_etcd(stack))


async def _until(cond: Callable[[], bool], what: str, within: float) -> float:
    started = time.monotonic()
    while not cond():
        assert time.monotonic() - started < within, f"{what}: not within {within}s"
        await asyncio.sleep(0.05)
    return time.monotonic() - started


async def _kill_etcd(stack: LocalStack) -> None:
    assert stack.writer is not None
    writer = stack.writer
    member = stack.etcds[0]
    killed_pid = member.pid
    member.signal(signal.SIGKILL)
    await _until(lambda: member.alive() and member.pid != killed_pid, "etcd restarted by the supervisor", 10)
    assert stack.etcd_restarts == 1
    want = {registry.endpoint_key(NAMESPACE, CLUSTER, w.endpoint(stack.model)).encode() for w in stack.workers}
    reader = client(stack.etcd_endpoints)
    try:
        started = time.monotonic()
        while True:
            try:
                async with asyncio.timeout(1):
                    listing = await reader.get_prefix(registry.cluster_prefix(NAMESPACE, CLUSTER).encode())
                if {kv.key for kv in listing} == want and {kv.lease for kv in listing} == {writer.lease_id}:
                    break
            except (TimeoutError, EtcdError):
                pass  # the restarted member is not serving yet
            assert time.monotonic() - started < 30, "the workers' keys are not back"
            await asyncio.sleep(0.05)
    finally:
        await close_client(reader)
    await _until(lambda: writer.outage_since is None, "the writer refreshing its lease again", 5)
