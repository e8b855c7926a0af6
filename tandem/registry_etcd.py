"""The thin etcd adapter of ``tandem.registry`` (aetcd): a lease-keeping writer and a prefix watcher.

- ``EndpointWriter`` puts endpoints under one lease and refreshes it every ``ttl/3`` seconds, so endpoints of a
  writer that dies disappear after ``ttl``; ``remove`` deletes a key at once (fencing), ``close`` revokes the
  lease. Used by the local stack and the operator.
- ``EndpointWatcher`` lists a cluster's prefix, then watches it from the next revision: a PUT upserts, a DELETE
  (or lease expiry) removes the endpoint at once. It re-lists after a lost connection, so the callbacks always
  converge to etcd's current content. Malformed values are logged and skipped, never crash the router.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
from collections.abc import Callable, Sequence
from typing import Any

import aetcd
import pydantic

from tandem import registry
from tandem.registry import Endpoint

log = logging.getLogger("tandem.registry")

OnSnapshot = Callable[[dict[str, Endpoint]], None]
OnPut = Callable[[str, Endpoint], None]
OnDelete = Callable[[str], None]


def parse_endpoint_url(endpoint: str) -> tuple[str, int]:
    """``host:port`` (or ``http://host:port``) of an etcd client URL."""
    hostport = endpoint.split("://", 1)[-1].rstrip("/")
    host, _, port = hostport.rpartition(":")
    if not host or not port.isdigit():
        raise ValueError(f"etcd endpoint must be host:port, got {endpoint!r}")
    return host, int(port)


def client(endpoints: Sequence[str], timeout: int = 5) -> Any:
    """An aetcd client for the first endpoint (aetcd talks to one member; etcd proxies to the leader)."""
    host, port = parse_endpoint_url(endpoints[0])
    return aetcd.Client(host=host, port=port, timeout=timeout)


class EndpointWriter:
    def __init__(self, endpoints: Sequence[str], namespace: str, cluster: str, ttl: int = 5) -> None:
        self.namespace, self.cluster, self.ttl = namespace, cluster, ttl
        self._client = client(endpoints)
        self._lease: Any = None
        self._keepalive: asyncio.Task[None] | None = None

    async def start(self) -> None:
        await self._client.connect()
        self._lease = await self._client.lease(self.ttl)
        self._keepalive = asyncio.create_task(self._keep_alive())

    async def put(self, endpoint: Endpoint) -> str:
        key = registry.endpoint_key(self.namespace, self.cluster, endpoint)
        await self._client.put(key.encode(), registry.encode(endpoint), lease=self._lease)
        return key

    async def remove(self, endpoint: Endpoint) -> None:
        await self._client.delete(registry.endpoint_key(self.namespace, self.cluster, endpoint).encode())

    async def close(self) -> None:
        if self._keepalive is not None:
            self._keepalive.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await self._keepalive
        if self._lease is not None:
            with contextlib.suppress(Exception):
                await self._lease.revoke()
        await self._client.close()

    async def _keep_alive(self) -> None:
        while True:
            await asyncio.sleep(self.ttl / 3)
            try:
                await self._lease.refresh()
            except Exception as err:  # a lost etcd is reported; the next refresh tries again
                log.warning("etcd lease refresh failed", extra={"error": repr(err)})


class EndpointWatcher:
    def __init__(
        self,
        endpoints: Sequence[str],
        namespace: str,
        cluster: str,
        *,
        on_snapshot: OnSnapshot,
        on_put: OnPut,
        on_delete: OnDelete,
        retry_s: float = 1.0,
    ) -> None:
        self.prefix = registry.cluster_prefix(namespace, cluster).encode()
        self.endpoints = list(endpoints)
        self.on_snapshot, self.on_put, self.on_delete = on_snapshot, on_put, on_delete
        self.retry_s = retry_s
        self.synced = asyncio.Event()
        self._task: asyncio.Task[None] | None = None

    def start(self) -> None:
        self._task = asyncio.create_task(self._run())

    async def stop(self) -> None:
        if self._task is not None:
            self._task.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await self._task

    async def _run(self) -> None:
        while True:
            etcd = client(self.endpoints)
            try:
                await etcd.connect()
                await self._sync_and_watch(etcd)
            except asyncio.CancelledError:
                raise
            except Exception as err:
                log.warning("etcd watch lost; re-listing", extra={"error": repr(err)})
            finally:
                with contextlib.suppress(Exception):
                    await etcd.close()
            await asyncio.sleep(self.retry_s)

    async def _sync_and_watch(self, etcd: Any) -> None:
        listing = await etcd.get_prefix(self.prefix)
        snapshot: dict[str, Endpoint] = {}
        for kv in listing:
            endpoint = _parse(kv.key, kv.value)
            if endpoint is not None:
                snapshot[kv.key.decode()] = endpoint
        self.on_snapshot(snapshot)
        self.synced.set()
        watch = await etcd.watch_prefix(self.prefix, start_revision=listing.header.revision + 1)
        async for event in watch:
            key = event.kv.key.decode()
            if event.kind == "DELETE":
                self.on_delete(key)
                continue
            endpoint = _parse(event.kv.key, event.kv.value)
            if endpoint is None:
                self.on_delete(key)
            else:
                self.on_put(key, endpoint)


def _parse(key: bytes, value: bytes) -> Endpoint | None:
    try:
        return registry.decode(value)
    except pydantic.ValidationError as err:
        log.error("malformed registry value skipped", extra={"key": key.decode(errors="replace"), "error": str(err)})
        return None
