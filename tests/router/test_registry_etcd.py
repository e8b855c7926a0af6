"""The etcd registry adapter and the router's etcd discovery against a real etcd (Debian etcd-server)."""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator, Iterator
from pathlib import Path

import aiohttp
import pytest

from tandem import registry
from tandem.leased_writer import LeasedWriter
from tandem.registry import Endpoint, Role
from tandem.registry_etcd import EndpointWatcher, parse_endpoint_url
from tandem_dev.local_stack import instant_worker_argv, start_etcd
from tandem_dev.procs import ManagedProcess
from tandem_dev.stack_fixture import running_stack

pytestmark = pytest.mark.procs


@pytest.fixture(scope="module")
def etcd(tmp_path_factory: pytest.TempPathFactory) -> Iterator[str]:
    proc, endpoint = start_etcd(tmp_path_factory.mktemp("etcd"))
    yield endpoint
    proc.stop()


def _ep(group: str, port: int, epoch: int = 0) -> Endpoint:
    return Endpoint(role=Role.DECODE, group=group, url=f"http://127.0.0.1:{port}", model="m", epoch=epoch)


@pytest.fixture
async def watched(etcd: str) -> AsyncIterator[tuple[dict[str, Endpoint], EndpointWatcher]]:
    seen: dict[str, Endpoint] = {}

    def snapshot(eps: dict[str, Endpoint]) -> None:
        seen.clear()
        seen.update(eps)

    def delete(key: str) -> None:
        seen.pop(key, None)

    watcher = EndpointWatcher([etcd], "ns", "c1", on_snapshot=snapshot, on_put=seen.__setitem__, on_delete=delete)
    yield seen, watcher
    await watcher.stop()


async def _put(writer: LeasedWriter, endpoint: Endpoint, cluster: str = "c1") -> str:
    key = registry.endpoint_key("ns", cluster, endpoint)
    await writer.put(key, registry.encode(endpoint))
    return key


async def _until(cond: object, within: float = 10.0) -> None:
    deadline = asyncio.get_running_loop().time() + within
    while not cond():  # type: ignore[operator]
        assert asyncio.get_running_loop().time() < deadline, "condition not reached"
        await asyncio.sleep(0.02)


def test_parse_endpoint_url() -> None:
    assert parse_endpoint_url("127.0.0.1:2379") == ("127.0.0.1", 2379)
    assert parse_endpoint_url("http://etcd.ns.svc:2379/") == ("etcd.ns.svc", 2379)
    with pytest.raises(ValueError, match="host:port"):
        parse_endpoint_url("nohost")


async def test_watcher_sees_existing_new_changed_and_deleted_endpoints(
    etcd: str, watched: tuple[dict[str, Endpoint], EndpointWatcher]
) -> None:
    seen, watcher = watched
    writer = LeasedWriter([etcd], ttl=30)
    await writer.start()
    try:
        first = _ep("decode-0", 1000)
        key0 = await _put(writer, first)
        watcher.start()
        await asyncio.wait_for(watcher.synced.wait(), 10)
        assert seen == {key0: first}
        key1 = await _put(writer, _ep("decode-1", 1001))
        await _until(lambda: key1 in seen)
        await _put(writer, _ep("decode-1", 1001, epoch=1))
        await _until(lambda: seen[key1].epoch == 1)
        assert await writer.delete(key0)
        await _until(lambda: key0 not in seen)
        # A malformed value is skipped (and drops the key), never crashes the watcher.
        await writer.client.put(key1.encode(), b"{not json")
        await _until(lambda: key1 not in seen)
    finally:
        await writer.close(revoke=True)


async def test_router_counts_a_recreated_group_that_reuses_a_mooncake_session(etcd: str) -> None:
    from tandem_router.config import DiscoveryMode, RouterEtcdSettings, RouterSettings
    from tandem_router.discovery_etcd import EtcdDiscovery
    from tandem_router.pool import WorkerPool
    from tests.tandem.test_registry import incarnation

    pool = WorkerPool()
    settings = RouterSettings(
        discovery=DiscoveryMode.ETCD,
        etcd=RouterEtcdSettings(endpoints=[etcd]),
        cluster_namespace="ns",
        cluster_name="reuse",
    )
    discovery = EtcdDiscovery(pool, settings)
    writer = LeasedWriter([etcd], ttl=30)
    await writer.start()
    try:
        await discovery.start()
        await _put(writer, incarnation(0, "10.0.0.1:15100", "10.0.0.1:15101"), "reuse")
        await _until(lambda: any(w.spec.epoch == 0 for w in pool.workers.values()))
        # fenced: the key goes before the next incarnation comes
        await writer.delete(registry.endpoint_key("ns", "reuse", incarnation(0)))
        await _until(lambda: not pool.workers)
        await _put(writer, incarnation(1, "10.0.0.1:15102", "10.0.0.1:15103"), "reuse")  # the next window: no reuse
        await _until(lambda: any(w.spec.epoch == 1 for w in pool.workers.values()))
        assert pool.mooncake_session_reuses == 0
        # a range too small to rotate
        await _put(writer, incarnation(2, "10.0.0.1:15100", "10.0.0.1:15101", "10.0.0.1:15103"), "reuse")
        await _until(lambda: any(w.spec.epoch == 2 for w in pool.workers.values()))
        assert pool.mooncake_session_reuses == 1
        # the rotation wrapped: epoch 3 takes epoch 1's window, which epoch 2 did not hold
        await _put(writer, incarnation(3, "10.0.0.1:15102"), "reuse")
        await _until(lambda: any(w.spec.epoch == 3 for w in pool.workers.values()))
        assert pool.mooncake_session_reuses == 2
    finally:
        await discovery.stop()
        await writer.close(revoke=True)


async def test_lease_expiry_drops_the_endpoints_of_a_dead_writer(
    etcd: str, watched: tuple[dict[str, Endpoint], EndpointWatcher]
) -> None:
    seen, watcher = watched
    writer = LeasedWriter([etcd], ttl=2)
    await writer.start()
    key = await _put(writer, _ep("decode-7", 1007))
    watcher.start()
    await _until(lambda: key in seen)
    await asyncio.sleep(3)  # kept alive past its TTL
    assert key in seen
    await writer.close(revoke=False)  # the writer "dies": nobody refreshes the lease any more
    await _until(lambda: key not in seen, within=10)


def test_local_stack_registers_routes_and_replaces_a_killed_worker(tmp_path: Path) -> None:
    """The `tandem up` stack with instant workers: registration in etcd, routing, restart on death."""
    import signal

    with running_stack(tmp_path, router_port=0, worker_argv=instant_worker_argv, model="instant-model") as stack:

        async def scenario() -> None:
            async with aiohttp.ClientSession() as http:
                body = {"model": "instant-model", "messages": [{"role": "user", "content": "hi"}]}
                for _ in range(4):
                    async with http.post(f"{stack.router_url}/v1/chat/completions", json=body) as resp:
                        assert resp.status == 200
                victim = stack.workers[-1]
                victim_proc: ManagedProcess = victim.proc
                victim_proc.signal(signal.SIGKILL)
                await _until(lambda: victim.epoch == 1 and victim.registered, within=60)
                for _ in range(8):
                    async with http.post(f"{stack.router_url}/v1/chat/completions", json=body) as resp:
                        assert resp.status == 200
                assert stack.restarts == 1

        asyncio.run(scenario())


async def test_a_registry_that_comes_back_forged_or_empty_takes_no_healthy_worker_out(
    etcd: str, tmp_path: Path
) -> None:
    """Every value overwritten without the operator's signature, then the whole prefix gone: a storm both times,
    so the four workers (healthy: no check has failed them) stay in routing; the operator's values back end it; gone
    again, they leave once the connected registry has settled without them."""
    from tandem.registry_signing import EndpointSigner, registry_entry, write_keypair
    from tandem_router.config import DiscoveryMode, RouterEtcdSettings, RouterSettings
    from tandem_router.discovery_etcd import EtcdDiscovery
    from tandem_router.pool import WorkerPool

    write_keypair(tmp_path / "signing.pem", tmp_path / "verify.pem")
    signer = EndpointSigner.from_file(tmp_path / "signing.pem")
    settings = RouterSettings(
        discovery=DiscoveryMode.ETCD, etcd=RouterEtcdSettings(endpoints=[etcd]), cluster_namespace="ns",
        cluster_name="storm", registry_verify_key=tmp_path / "verify.pem",
    )  # fmt: skip
    endpoints = [_ep(f"decode-{i}", 2100 + i) for i in range(4)]
    pool = WorkerPool()
    discovery = EtcdDiscovery(pool, settings)
    writer = LeasedWriter([etcd], ttl=30)
    await writer.start()
    try:
        for endpoint in endpoints:
            await writer.put(*registry_entry("ns", "storm", endpoint, signer))
        await discovery.start()
        await _until(lambda: len(pool.workers) == 4)
        for endpoint in endpoints:  # someone else's values over every key
            await writer.client.put(registry.endpoint_key("ns", "storm", endpoint).encode(), registry.encode(endpoint))
        await _until(lambda: pool.forged_endpoints == 4)
        assert len(pool.workers) == 4
        assert discovery.guard.panicking
        await writer.client.delete_prefix(registry.cluster_prefix("ns", "storm").encode())  # back empty
        await asyncio.sleep(0.3)
        assert len(pool.workers) == 4
        for endpoint in endpoints:
            await writer.put(*registry_entry("ns", "storm", endpoint, signer))
        await _until(lambda: not discovery.guard.panicking)
        assert len(pool.workers) == 4
        await writer.delete_prefix(registry.cluster_prefix("ns", "storm"))
        await _until(lambda: discovery.guard.panicking)
        discovery.tick(asyncio.get_running_loop().time() + settings.registry_settle_s + 1)
        assert pool.workers == {}
        assert not discovery.guard.panicking
    finally:
        await discovery.stop()
        await writer.close(revoke=True)
