"""The operator's etcd adapter: endpoint keys under one kept-alive lease, fencing deletes, Mooncake cleanup.

One ``Registrar`` per etcd cluster (PDClusters that name the same endpoints share it): one client, one lease,
refreshed every ``ttl / 3``. If etcd reports the lease gone (a long partition outlived the TTL), a new lease is
granted and ``on_lease_lost`` is called so the owner re-puts every entry it advertises. Keys of a crashed
operator expire with its lease; a restarted operator lists the prefix (``list_endpoints``) and re-puts under its
own lease, so registrations survive a restart that is quicker than the TTL.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
from collections.abc import Awaitable, Callable, Sequence
from typing import Any

import pydantic

from tandem import registry
from tandem.registry import Endpoint, EtcdTLS
from tandem.registry_etcd import client as etcd_client
from tandem.registry_etcd import close_client
from tandem.registry_signing import EndpointSigner
from tandem_operator.fencing import StaleKeys
from tandem_operator.observe import GroupKey
from tandem_operator.registration import parse_group

log = logging.getLogger("tandem.operator.registry")

OnLeaseLost = Callable[[], Awaitable[None]]


class Registrar:
    def __init__(
        self,
        endpoints: Sequence[str],
        ttl: int = 10,
        tls: EtcdTLS | None = None,
        signer: EndpointSigner | None = None,
        mooncake_endpoints: Sequence[str] = (),
    ) -> None:
        self.endpoints, self.ttl, self.tls, self.signer = tuple(endpoints), ttl, tls, signer
        self._client = etcd_client(endpoints, tls=tls)
        # Mooncake's keys, when they live in an etcd of their own (spec.etcd.mooncakeEndpoints: plaintext, no user)
        self._mooncake = etcd_client(mooncake_endpoints) if mooncake_endpoints else None
        self._lease: Any = None
        self._keepalive: asyncio.Task[None] | None = None
        self._listeners: list[OnLeaseLost] = []
        self._lease_lock = asyncio.Lock()

    def on_lease_lost(self, callback: OnLeaseLost) -> None:
        self._listeners.append(callback)

    async def start(self) -> None:
        await self._client.connect()
        if self._mooncake is not None:
            await self._mooncake.connect()
        self._lease = await self._client.lease(self.ttl)
        self._keepalive = asyncio.create_task(self._keep_alive(), name=f"etcd-lease-{self.endpoints[0]}")

    async def close(self) -> None:
        """Stop refreshing, keep the keys: they expire with the lease unless a new operator re-puts them first."""
        if self._keepalive is not None:
            self._keepalive.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await self._keepalive
        await close_client(self._client)
        if self._mooncake is not None:
            await close_client(self._mooncake)

    async def put(self, namespace: str, cluster: str, endpoint: Endpoint) -> str:
        key = registry.endpoint_key(namespace, cluster, endpoint)
        if self.signer is not None:
            endpoint = self.signer.sign(key, endpoint)
        await self._client.put(key.encode(), registry.encode(endpoint), lease=self._lease)
        return key

    async def fence(self, namespace: str, cluster: str, group: GroupKey) -> bool:
        """Delete the group's endpoint key; True if it existed."""
        key = f"{registry.cluster_prefix(namespace, cluster)}{group.role.value}/{group.name}"
        return await self._client.delete(key.encode()) is not None

    async def remove_cluster(self, namespace: str, cluster: str) -> None:
        await self._client.delete_prefix(registry.cluster_prefix(namespace, cluster).encode())

    async def list_endpoints(self, namespace: str, cluster: str) -> dict[GroupKey, Endpoint]:
        """The cluster's entries now in etcd (a previous operator's included), without their signatures (as the
        deciders build them); malformed ones, and with a signing key unsigned or forged ones, are skipped, so the
        next sync overwrites them."""
        found: dict[GroupKey, Endpoint] = {}
        for kv in await self._client.get_prefix(registry.cluster_prefix(namespace, cluster).encode()):
            key = kv.key.decode(errors="replace")
            try:
                endpoint = registry.decode(kv.value)
            except pydantic.ValidationError:
                log.warning("malformed registry entry ignored", extra={"key": key})
                continue
            if self.signer is not None and not self.signer.verifier.verify(key, endpoint):
                log.error("registry entry without a valid operator signature ignored", extra={"key": key})
                continue
            endpoint = endpoint.model_copy(update={"signature": ""})
            group = parse_group(endpoint)
            if group is not None:
                found[group] = endpoint
        return found

    async def delete_stale(self, stale: StaleKeys) -> int:
        """Delete stale Mooncake metadata (in Mooncake's own etcd, if it has one); returns how many keys went."""
        etcd, deleted = self._mooncake or self._client, 0
        for key in stale.keys:
            deleted += await etcd.delete(key.encode()) is not None
        for prefix in stale.prefixes:
            result = await etcd.delete_prefix(prefix.encode())
            deleted += int(getattr(result, "deleted", 0))
        return deleted

    async def _keep_alive(self) -> None:
        while True:
            await asyncio.sleep(self.ttl / 3)
            try:
                reply = await self._client.refresh_lease(self._lease.id)
                alive = reply is not None and reply.TTL > 0
            except Exception as err:  # etcd unreachable: report and retry; the lease may still be alive
                log.warning("etcd lease refresh failed", extra={"error": repr(err), "etcd": self.endpoints[0]})
                continue
            if not alive:
                await self._renew_lease()

    async def _renew_lease(self) -> None:
        async with self._lease_lock:
            log.warning("etcd lease expired; granting a new one and re-registering", extra={"etcd": self.endpoints[0]})
            self._lease = await self._client.lease(self.ttl)
        for callback in self._listeners:
            try:
                await callback()
            except Exception:
                log.exception("re-registration after a lost lease failed")
