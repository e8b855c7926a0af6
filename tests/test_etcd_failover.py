"""The registry's etcd clients when etcd fails, on real etcd processes (Debian etcd-server) on loopback.

- etcd restarted while watched: the router's endpoint watcher and the operator's integrity watcher (both one
  ``PrefixWatcher``) re-list and keep following changes.
- a 3-member etcd with a member down: every endpoint is tried, so the router (a real router process, through
  the local stack) and the operator's registrar and integrity watcher keep working.
"""

from __future__ import annotations

import asyncio
import signal
from collections.abc import AsyncIterator, Awaitable, Callable, Iterator
from contextlib import asynccontextmanager
from pathlib import Path
from typing import Any

import aiohttp
import pytest

from tandem import registry
from tandem.integrity_watch import IntegrityWatcher
from tandem.registry import Endpoint, IntegrityReport, Role
from tandem.registry_etcd import EndpointWatcher, client
from tandem_dev.local_stack import (
    MODEL,
    LocalStack,
    instant_worker_argv,
    start_etcd,
    start_etcd_cluster,
)
from tandem_dev.procs import ManagedProcess
from tandem_dev.stack_fixture import running_stack
from tandem_operator.act.registrar import Registrar
from tandem_operator.decide.observe import GroupKey
from tests.plumbing.routermetrics import scrape
from tests.tandem_dev.devcluster.devcluster_fixtures import eventually

pytestmark = pytest.mark.procs
NS, CL = "ns", "c1"


def _endpoint(group: str, epoch: int = 0) -> Endpoint:
    return Endpoint(role=Role.DECODE, group=group, url=f"http://127.0.0.1:{1000 + len(group)}", model="m", epoch=epoch)


def _report(router: str) -> IntegrityReport:
    return IntegrityReport(router=router)


@asynccontextmanager
async def watchers(endpoints: list[str]) -> AsyncIterator[tuple[dict[str, Endpoint], dict[str, IntegrityReport]]]:
    """The router's endpoint watcher and the operator's integrity watcher on ``NS/CL``: what each sees now."""
    endpoints_seen: dict[str, Endpoint] = {}
    reports_seen: dict[str, IntegrityReport] = {}

    def snapshot(current: dict[str, Endpoint]) -> None:
        endpoints_seen.clear()
        endpoints_seen.update(current)

    def delete(key: str) -> None:
        endpoints_seen.pop(key, None)

    async def reports(current: dict[str, IntegrityReport]) -> None:
        reports_seen.clear()
        reports_seen.update(current)

    router_watch = EndpointWatcher(
        endpoints, NS, CL, on_snapshot=snapshot, on_put=endpoints_seen.__setitem__,
        on_delete=delete, retry_s=0.2,
    )  # fmt: skip
    operator_watch = IntegrityWatcher(endpoints, NS, CL, reports, retry_s=0.2)
    router_watch.start()
    operator_watch.start()
    try:
        yield endpoints_seen, reports_seen
    finally:
        await router_watch.stop()
        await operator_watch.stop()


async def _write(endpoints: list[str], change: Callable[[Any], Awaitable[object]]) -> None:
    """Apply ``change`` to a fresh client, retrying while etcd is coming back (a real writer retries too)."""

    async def once() -> bool:
        etcd = client(endpoints)
        try:
            await change(etcd)
            return True
        except Exception:
            return False
        finally:
            await etcd.close()

    await eventually(once, "an etcd write", within=30)


def _put_endpoint(endpoint: Endpoint) -> Callable[[Any], Awaitable[object]]:
    key = registry.endpoint_key(NS, CL, endpoint).encode()
    return lambda etcd: etcd.put(key, registry.encode(endpoint))


def _put_report(report: IntegrityReport) -> Callable[[Any], Awaitable[object]]:
    key = registry.integrity_key(NS, CL, report.router).encode()
    return lambda etcd: etcd.put(key, report.model_dump_json().encode())


def _delete(key: str) -> Callable[[Any], Awaitable[object]]:
    return lambda etcd: etcd.delete(key.encode())


async def _sees(
    seen: tuple[dict[str, Endpoint], dict[str, IntegrityReport]], groups: set[str], routers: set[str], what: str
) -> None:
    async def check() -> bool:
        return {e.group for e in seen[0].values()} == groups and {r.router for r in seen[1].values()} == routers

    await eventually(check, what, within=30)


async def test_watchers_relist_and_keep_watching_after_etcd_restarts(tmp_path: Path) -> None:
    etcd, endpoint = await asyncio.to_thread(start_etcd, tmp_path)
    try:
        await _write([endpoint], _put_endpoint(_endpoint("decode-0")))
        await _write([endpoint], _put_report(_report("router-a")))
        async with watchers([endpoint]) as seen:
            await _sees(seen, {"decode-0"}, {"router-a"}, "the first listing")
            await _write([endpoint], _put_endpoint(_endpoint("decode-1")))
            await _sees(seen, {"decode-0", "decode-1"}, {"router-a"}, "a watched change")

            etcd.signal(signal.SIGKILL)
            await asyncio.to_thread(etcd.stop)
            etcd.start()  # same ports, same data
            await asyncio.to_thread(etcd.wait_http, f"http://{endpoint}/health", 30)
            # Changed as soon as etcd is back: before or after the watchers reconnect, both must converge.
            await _write([endpoint], _delete(registry.endpoint_key(NS, CL, _endpoint("decode-0"))))
            await _write([endpoint], _put_report(_report("router-b")))
            await _sees(seen, {"decode-1"}, {"router-a", "router-b"}, "the state after etcd restarted")
            # ... and they keep watching: a later change arrives too.
            await _write([endpoint], _put_endpoint(_endpoint("decode-2")))
            await _write([endpoint], _delete(registry.integrity_key(NS, CL, "router-a")))
            await _sees(seen, {"decode-1", "decode-2"}, {"router-b"}, "a change after the restart")
    finally:
        etcd.stop()


@pytest.fixture
def three_members(tmp_path: Path) -> Iterator[tuple[list[ManagedProcess], list[str]]]:
    members = start_etcd_cluster(tmp_path, 3)
    yield [proc for proc, _ in members], [endpoint for _, endpoint in members]
    for proc, _ in members:
        proc.stop()


async def test_operator_adapters_use_every_etcd_member(three_members: tuple[list[ManagedProcess], list[str]]) -> None:
    procs, endpoints = three_members
    procs[0].stop()  # the first endpoint is down from the start
    registrar = Registrar(endpoints, ttl=10)
    await registrar.start()
    try:
        async with watchers(endpoints) as seen:
            await registrar.put(NS, CL, _endpoint("decode-0"))
            await _write(endpoints, _put_report(_report("router-a")))
            await _sees(seen, {"decode-0"}, {"router-a"}, "entries written with the first member down")
            # The member the clients are connected to now dies: they move to the last one left with quorum.
            procs[0].start()
            await asyncio.to_thread(procs[0].wait_http, f"http://{endpoints[0]}/health", 30)
            procs[1].stop()

            async def put_and_list() -> bool:
                try:
                    await registrar.put(NS, CL, _endpoint("decode-1"))
                    return GroupKey(Role.DECODE, 1) in await registrar.list_endpoints(NS, CL)
                except Exception:
                    return False  # the request in flight when its member died

            await eventually(put_and_list, "a registrar write and listing after a second member died", within=30)
            assert await registrar.fence(NS, CL, GroupKey(Role.DECODE, 0))
            await _sees(seen, {"decode-1"}, {"router-a"}, "the watchers following a live member")
    finally:
        await registrar.close()


def test_router_follows_the_registry_with_an_etcd_member_down(tmp_path: Path) -> None:
    with running_stack(
        tmp_path, router_port=0, worker_argv=instant_worker_argv, etcd_members=3, restart=False, restart_etcd=False
    ) as stack:
        asyncio.run(_member_down(stack))


async def _member_down(stack: LocalStack) -> None:
    assert {w.url for w in stack.workers} <= (await scrape(stack.router_url)).in_flight.keys()
    stack.etcds[0].signal(signal.SIGKILL)  # the member every client dials first
    victim = stack.workers[0]
    victim.proc.signal(signal.SIGKILL)  # the supervisor deletes its key (through a live member)

    async def dropped() -> bool:  # only the router's registry watch removes a worker from its pool
        return victim.url not in (await scrape(stack.router_url)).in_flight

    await eventually(dropped, "the router dropping the deregistered worker", within=30)
    async with aiohttp.ClientSession() as http:
        body = {"model": MODEL, "messages": [{"role": "user", "content": "hi"}], "max_tokens": 4}
        async with http.post(f"{stack.router_url}/v1/chat/completions", json=body) as resp:
            assert resp.status == 200, await resp.text()
