"""The operator's etcd adapter: endpoint keys under one kept-alive lease, fencing deletes, Mooncake cleanup.

One ``Registrar`` per etcd cluster (PDClusters that name the same endpoints share it), writing through one
``tandem.leased_writer.LeasedWriter``: one client, one lease, refreshed every ``ttl / 3``, retried every half second
while etcd does not answer. If the lease is gone when etcd answers again (frozen or partitioned for longer than the
TTL), the writer grants a new one, re-puts every entry it advertises, then calls ``on_lease_lost`` so the owner
re-puts from its own state too. Keys of a crashed operator expire with its lease; a restarted operator lists the
prefix (``list_endpoints``) and re-puts under its own lease, so registrations survive a restart that is quicker
than the TTL. A call that etcd does not answer or refuses raises ``tandem.etcd_errors.EtcdError``.
"""

from __future__ import annotations

import logging
from collections.abc import Sequence

from tandem import registry
from tandem.leased_writer import LeasedWriter, OnLeaseLost
from tandem.registry import Endpoint, EtcdTLS
from tandem.registry_etcd import client as etcd_client
from tandem.registry_etcd import close_client
from tandem.registry_signing import EndpointSigner, registry_entry
from tandem.registry_versions import EntryRefusedError
from tandem_operator.decide.fencing import StaleKeys
from tandem_operator.decide.observe import GroupKey
from tandem_operator.decide.registration import parse_group

log = logging.getLogger("tandem.operator.registry")


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
        self.writer = LeasedWriter(endpoints, ttl, tls=tls)
        # Mooncake's keys, when they live in an etcd of their own (spec.etcd.mooncakeEndpoints: plaintext, no user)
        self._mooncake = etcd_client(mooncake_endpoints) if mooncake_endpoints else None

    def on_lease_lost(self, callback: OnLeaseLost) -> None:
        self.writer.on_lease_lost(callback)

    async def start(self) -> None:
        await self.writer.start()
        if self._mooncake is not None:
            await self._mooncake.connect()

    async def close(self) -> None:
        """Stop refreshing, keep the keys: they expire with the lease unless a new operator re-puts them first."""
        await self.writer.close(revoke=False)
        if self._mooncake is not None:
            await close_client(self._mooncake)

    async def put(self, namespace: str, cluster: str, endpoint: Endpoint) -> str:
        key, value = registry_entry(namespace, cluster, endpoint, self.signer)
        await self.writer.put(key, value)
        return key

    async def fence(self, namespace: str, cluster: str, group: GroupKey) -> bool:
        """Delete the group's endpoint key at once (and never re-put it after a lost lease); True if it existed."""
        key = f"{registry.cluster_prefix(namespace, cluster)}{group.role.value}/{group.name}"
        return await self.writer.delete(key)

    async def remove_cluster(self, namespace: str, cluster: str) -> None:
        await self.writer.delete_prefix(registry.cluster_prefix(namespace, cluster))

    async def list_endpoints(self, namespace: str, cluster: str) -> dict[GroupKey, Endpoint]:
        """The cluster's entries now in etcd (a previous operator's included), without their signatures (as the
        deciders build them); malformed ones or ones of a schema version this operator does not read
        (``tandem.registry_versions``), and with a signing key unsigned or forged ones, are skipped, so the next sync
        overwrites them. The next sync re-puts every entry anyway, stamped with this operator's schema version."""
        found: dict[GroupKey, Endpoint] = {}
        for kv in await self.writer.client.get_prefix(registry.cluster_prefix(namespace, cluster).encode()):
            key = kv.key.decode(errors="replace")
            try:
                endpoint = registry.decode(kv.value)
            except EntryRefusedError as err:
                extra = {"key": key, "reason": err.reason.value, "error": err.detail}
                log.warning("registry entry ignored", extra=extra)
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
        etcd, deleted = self._mooncake or self.writer.client, 0
        for key in stale.keys:
            deleted += await etcd.delete(key.encode()) is not None
        for prefix in stale.prefixes:
            result = await etcd.delete_prefix(prefix.encode())
            deleted += int(getattr(result, "deleted", 0))
        return deleted
