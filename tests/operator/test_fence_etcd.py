"""The registry adapter and the event-driven fence path against a real etcd and real Mooncake engines.

No API server runs in this test (the control plane fixtures are on another branch): the runtime's Kubernetes
Events go to ``EventSink``, a stand-in that records them, and pod events are fed to ``on_pod_event`` as kopf
would deliver them. Everything else is real: etcd, the lease, Mooncake's own metadata keys.
"""

from __future__ import annotations

import asyncio
import os
import sys
import time
from collections.abc import AsyncIterator
from pathlib import Path
from typing import Any

import pytest

from tandem import registry
from tandem.registry import Role
from tandem.registry_etcd import client as etcd_client
from tandem_dev.procs import ManagedProcess, free_port
from tandem_operator.act.k8s.kube import Kube
from tandem_operator.act.registrar import Registrar
from tandem_operator.decide.observe import GroupKey
from tandem_operator.decide.registration import leader_endpoint
from tandem_operator.run.runtime import ClusterRuntime, RuntimeOptions
from tests.operator.conftest import kimi_spec
from tests.operator.fakes import NoServer
from tests.operator.workers import CLUSTER, live_pod

pytestmark = pytest.mark.netns
SPEC = kimi_spec(transfer={"protocol": "tcp"})
PEER = Path(__file__).with_name("mooncake_peer.py")


class EventSink(Kube):
    """Records the Events the runtime posts (no API server in this test)."""

    def __init__(self) -> None:
        super().__init__(api=NoServer())
        self.events: list[dict[str, Any]] = []

    async def post(self, path: str, body: dict[str, Any]) -> dict[str, Any]:
        self.events.append(body)
        return body


@pytest.fixture
async def etcd(etcd_endpoint: str) -> AsyncIterator[Any]:
    client = etcd_client([etcd_endpoint])
    await client.connect()
    await client.delete_prefix(b"mooncake/")
    await client.delete_prefix(registry.ROOT.encode())
    yield client
    await client.close()


async def keys(client: Any, prefix: str) -> list[str]:
    return sorted(kv.key.decode() for kv in await client.get_prefix(prefix.encode()))


async def wait_for(predicate: Any, limit: float) -> float:
    start = time.monotonic()
    while not await predicate():
        if time.monotonic() - start > limit:
            raise TimeoutError("condition not met in time")
        await asyncio.sleep(0.01)
    return time.monotonic() - start


async def test_registrar_puts_fences_and_survives_a_lost_lease(etcd: Any, etcd_endpoint: str) -> None:
    endpoint = leader_endpoint(SPEC, Role.DECODE, live_pod(SPEC, Role.DECODE, 0, 0, ip="127.0.0.2"))
    assert endpoint is not None
    registrar = Registrar([etcd_endpoint], ttl=2)
    await registrar.start()
    lost = asyncio.Event()

    async def reput() -> None:
        await registrar.put("serving", "kimi", endpoint)
        lost.set()

    registrar.on_lease_lost(reput)
    try:
        key = await registrar.put("serving", "kimi", endpoint)
        assert await registrar.list_endpoints("serving", "kimi") == {GroupKey(Role.DECODE, 0): endpoint}
        # The lease vanishes (as after a partition longer than the TTL): a new one is granted, the writer re-puts
        # what it advertises, then the owner's callback runs.
        old_lease = registrar.writer.lease_id
        await etcd.revoke_lease(old_lease)
        assert await keys(etcd, key) == []
        await asyncio.wait_for(lost.wait(), 5)
        assert await keys(etcd, key) == [key]
        assert (await etcd.get(key.encode())).lease == registrar.writer.lease_id != old_lease
        assert await registrar.fence("serving", "kimi", GroupKey(Role.DECODE, 0)) is True
        assert await registrar.fence("serving", "kimi", GroupKey(Role.DECODE, 0)) is False
    finally:
        await registrar.close()


def start_peer(tmp_path: Path, name: str, etcd_endpoint: str, procs: list[ManagedProcess]) -> ManagedProcess:
    low = free_port()
    env = {
        "MC_METADATA_CLUSTER_ID": "serving.kimi",
        "MC_TCP_BIND_ADDRESS": "127.0.0.1",
        "MC_MIN_RPC_PORT": str(low),
        "MC_MAX_RPC_PORT": str(low + 20),
        "PYTHONPATH": os.pathsep.join(sys.path),
    }
    argv = [sys.executable, str(PEER), name, etcd_endpoint.split("://", 1)[1]]
    proc = ManagedProcess(f"mooncake-{name}", argv, tmp_path / f"peer-{name}.log", env=env).start()
    procs.append(proc)
    return proc


async def test_a_deleted_member_is_fenced_and_its_mooncake_metadata_removed(
    etcd: Any, etcd_endpoint: str, tmp_path: Path, proc_factory: list[ManagedProcess]
) -> None:
    # Two decode ranks of group 0 publish real Mooncake metadata: one named by IP, one by ip:port.
    leader = start_peer(tmp_path, "127.0.0.1", etcd_endpoint, proc_factory)
    follower = start_peer(tmp_path, "127.0.0.2:16000", etcd_endpoint, proc_factory)
    root = "mooncake/serving.kimi/"
    await etcd.put(f"{root}ram/127.0.0.10".encode(), b"{}")  # another pod's entry, sharing a string prefix

    async def published() -> bool:
        return len(await keys(etcd, root)) == 5

    await wait_for(published, 30)

    sink = EventSink()
    registrar = Registrar([etcd_endpoint], ttl=5)
    await registrar.start()
    runtime = ClusterRuntime(CLUSTER, SPEC, sink, registrar, RuntimeOptions("test"), dict)
    pods = [
        live_pod(SPEC, Role.DECODE, 0, 0, ip="127.0.0.1"),
        live_pod(SPEC, Role.DECODE, 0, 1, ip="127.0.0.2"),
        live_pod(SPEC, Role.DECODE, 1, 0, ip="127.0.0.3"),
    ]
    try:
        for pod in pods:
            await runtime.on_pod_event("ADDED", pod)
        for index in (0, 1):
            endpoint = leader_endpoint(SPEC, Role.DECODE, pods[2 * index])
            assert endpoint is not None
            await registrar.put("serving", "kimi", endpoint)
            runtime.state.registered[GroupKey(Role.DECODE, index)] = endpoint
        prefix = registry.cluster_prefix("serving", "kimi")
        assert await keys(etcd, prefix) == [f"{prefix}decode/decode-0", f"{prefix}decode/decode-1"]

        # The follower's process dies and its pod is deleted: the whole group is fenced.
        follower.stop()
        started = time.monotonic()
        decision = await runtime.on_pod_event("DELETED", pods[1])
        elapsed = time.monotonic() - started
        assert decision is not None
        assert decision.group == GroupKey(Role.DECODE, 0)
        assert await keys(etcd, prefix) == [f"{prefix}decode/decode-1"]
        assert await keys(etcd, root) == [f"{root}ram/127.0.0.10"]
        timing = runtime.state.fence_timings[-1]
        assert timing.fenced_s < 1.0
        assert timing.cleaned_s < 2.0
        assert timing.stale_keys == 4
        print(f"\nfence {timing.fenced_s * 1000:.1f} ms, cleanup {timing.cleaned_s * 1000:.1f} ms ({elapsed:.3f}s)")
        await asyncio.sleep(0)  # let the background Event posts run
        assert [e["reason"] for e in sink.events] == ["Fenced", "StaleMetadataRemoved"]
        # A second event of the same incarnation fences nothing again.
        assert await runtime.on_pod_event("DELETED", pods[0]) is None
        assert leader.alive()
    finally:
        await runtime.stop(unregister=True)
        await registrar.close()
    assert await keys(etcd, registry.cluster_prefix("serving", "kimi")) == []
