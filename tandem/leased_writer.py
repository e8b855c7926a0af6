"""One etcd lease whose keys come back by themselves: the writer the operator, the router and the local stack share.

Every key a component advertises (the operator's endpoints, a router's integrity report, the local stack's
workers) lives under one lease of its writer, so it disappears ``ttl`` seconds after the writer dies. The writer
remembers every key/value it advertises, so that losing the lease does not lose the keys for longer than etcd is
away:

- While etcd answers, the lease is refreshed every ``ttl / 3`` seconds.
- When a refresh fails, etcd is asked again every ``retry_s`` seconds, each call cut at ``call_timeout_s`` (an aetcd
  call to a frozen etcd otherwise hangs for the client's whole timeout), not only at the next ``ttl / 3``.
- Once etcd answers again and the lease is gone (an etcd frozen -- SIGSTOP, a hung disk -- or partitioned for longer
  than ``ttl`` revokes it on thawing, and every key under it goes in one revision), a new lease is granted, every
  advertised key is put again under it (in transactions, one revision per batch), and the ``on_lease_lost``
  callbacks run (the operator re-puts what it advertises from its own state).

``delete`` forgets a key and deletes it at once (fencing must not wait for anything), so a later lease loss never
brings it back. A put or delete waits for a re-advertisement in flight, so neither a stale value nor a deleted key
is written back over it. Reads go to ``client`` (``tandem.registry_etcd.Client``). Every failed etcd call raises
an ``EtcdError`` (``tandem.etcd_errors``): ``LeaseNotFoundError`` when the lease is gone.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import time
from collections.abc import Awaitable, Callable, Mapping, Sequence

from tandem import registry_etcd
from tandem.etcd_errors import EtcdError, LeaseNotFoundError, answered_within
from tandem.registry import EtcdTLS

log = logging.getLogger("tandem.registry.lease")

OnLeaseLost = Callable[[], Awaitable[None]]
TXN_OPS = 100  # puts per re-advertising transaction (etcd refuses a transaction of more than 128 ops by default)


def _bytes(key: bytes | str) -> bytes:
    return key.encode() if isinstance(key, str) else key


class LeasedWriter:
    def __init__(
        self,
        endpoints: Sequence[str],
        ttl: int,
        tls: EtcdTLS | None = None,
        *,
        retry_s: float = 0.5,
        call_timeout_s: float = 1.0,
    ) -> None:
        self.endpoints, self.ttl, self.retry_s, self.call_timeout_s = tuple(endpoints), ttl, retry_s, call_timeout_s
        self.client = registry_etcd.client(endpoints, tls=tls)  # for reads and for keys of no lease
        self.lease_grants = 0  # leases granted so far: 1 after start, one more per lost lease
        self._lease_id: int | None = None
        self._advertised: dict[bytes, bytes] = {}
        self._listeners: list[OnLeaseLost] = []
        self._lock = asyncio.Lock()  # orders puts and deletes against a re-advertisement
        self._lost = False  # the lease is gone: grant a new one
        self._stale = False  # a new lease has not got every advertised key yet
        self._wake = asyncio.Event()  # a put saw the lease gone: check now, not at the next refresh
        self._outage_since: float | None = None
        self._keepalive: asyncio.Task[None] | None = None
        self._notifying: set[asyncio.Task[None]] = set()

    @property
    def lease_id(self) -> int | None:
        return self._lease_id

    @property
    def advertised(self) -> Mapping[bytes, bytes]:
        return dict(self._advertised)

    @property
    def outage_since(self) -> float | None:
        """``time.monotonic()`` of the first failed refresh of the outage in progress; None while etcd answers."""
        return self._outage_since

    def on_lease_lost(self, callback: OnLeaseLost) -> None:
        """Call ``callback`` after a new lease replaced a lost one (the advertised keys are back by then)."""
        self._listeners.append(callback)

    async def start(self) -> None:
        """Connect and grant the lease; raises while etcd does not answer (a caller may call it again)."""
        if self._keepalive is not None:
            return
        await self.client.connect()
        lease = await self.client.lease(self.ttl)
        self._lease_id, self.lease_grants = lease.id, self.lease_grants + 1
        self._keepalive = asyncio.create_task(self._keep_alive(), name=f"etcd-lease-{self.endpoints[0]}")

    async def put(self, key: bytes | str, value: bytes) -> None:
        """Advertise ``key``: remembered, then put under the lease. A failed put raises, but the key stays
        remembered, and the keep-alive puts every advertised key again as soon as etcd answers."""
        key = _bytes(key)
        async with self._lock:
            if self._lease_id is None:
                raise RuntimeError("LeasedWriter.put before start()")
            self._advertised[key] = value
            landed = False
            try:
                await self.client.put(key, value, lease=self._lease_id)
                landed = True
            except LeaseNotFoundError:  # gone before the keep-alive noticed: replace it now
                self._lost = True
                raise
            finally:
                # Failed, or given up by its caller: every advertised key is put again once etcd answers (under a
                # new lease if this one is gone), so the key still lands without the caller trying again.
                if not landed:
                    self._stale = True
                    self._wake.set()

    async def delete(self, key: bytes | str) -> bool:
        """Stop advertising ``key`` and delete it now; True if it was in etcd."""
        key = _bytes(key)
        async with self._lock:
            self._advertised.pop(key, None)
            return await self.client.delete(key) is not None

    async def delete_prefix(self, prefix: bytes | str) -> int:
        """Stop advertising every key under ``prefix`` and delete them all (ours or not); how many went."""
        prefix = _bytes(prefix)
        async with self._lock:
            for key in [k for k in self._advertised if k.startswith(prefix)]:
                del self._advertised[key]
            result = await self.client.delete_prefix(prefix)
            return int(getattr(result, "deleted", 0))

    async def close(self, revoke: bool) -> None:
        """Stop refreshing. ``revoke``: the keys go now; otherwise they stay until the lease expires (a restarted
        operator adopts and re-puts them first)."""
        for task in [self._keepalive, *self._notifying]:
            if task is not None:
                task.cancel()
                with contextlib.suppress(asyncio.CancelledError):
                    await task
        self._keepalive = None
        if revoke and self._lease_id is not None:
            with contextlib.suppress(EtcdError):  # etcd away: the keys go when the lease expires
                await self.client.revoke_lease(self._lease_id)
        await registry_etcd.close_client(self.client)

    async def _keep_alive(self) -> None:
        delay = self.ttl / 3
        while True:
            with contextlib.suppress(TimeoutError):
                async with asyncio.timeout(delay):
                    await self._wake.wait()
            self._wake.clear()
            try:
                await self._check()
            except EtcdError as err:  # etcd frozen, away or refusing: ask again soon
                self._lost = self._lost or isinstance(err, LeaseNotFoundError)
                self._failed(err)
                delay = self.retry_s
                continue
            except Exception:  # last resort: a keep-alive that ended would let every advertised key expire
                log.exception("etcd lease keep-alive failed; retrying", extra={"etcd": self.endpoints[0]})
                delay = self.retry_s
                continue
            if self._outage_since is not None:
                outage_s = round(time.monotonic() - self._outage_since, 2)
                log.info("etcd answers again", extra={"etcd": self.endpoints[0], "outage_s": outage_s})
                self._outage_since = None
            delay = self.ttl / 3

    async def _check(self) -> None:
        """One round: refresh the lease; if it is gone, grant a new one; if one is new, advertise every key."""
        if not self._lost and not self._stale:
            async with self._answered_within("refresh_lease"):
                reply = await self.client.refresh_lease(self._lease_id)
            # etcd answers a refresh of a lease it does not have (any more) with TTL 0, not an error.
            self._lost = reply is None or reply.TTL <= 0
        if self._lost:
            async with self._answered_within("lease"):
                lease = await self.client.lease(self.ttl)
            log.warning(
                "etcd lease lost; re-advertising every key under a new lease",
                extra={"etcd": self.endpoints[0], "old_lease": self._lease_id, "lease": lease.id},
            )
            async with self._lock:
                self._lease_id, self.lease_grants = lease.id, self.lease_grants + 1
                self._lost, self._stale = False, True
        if self._stale:
            async with self._lock:
                await self._readvertise()
                self._stale = False
            task = asyncio.create_task(self._call_listeners(), name="etcd-lease-lost-callbacks")
            self._notifying.add(task)
            task.add_done_callback(self._notifying.discard)

    async def _readvertise(self) -> None:
        items = list(self._advertised.items())
        txn = self.client.transactions
        for start in range(0, len(items), TXN_OPS):
            ops = [txn.put(key, value, lease=self._lease_id) for key, value in items[start : start + TXN_OPS]]
            async with self._answered_within("transaction"):
                await self.client.transaction(compare=[], success=ops, failure=[])
        log.info("etcd keys re-advertised", extra={"etcd": self.endpoints[0], "keys": len(items)})

    async def _call_listeners(self) -> None:
        """In a task of its own, so that a slow owner never delays the next refresh."""
        for callback in self._listeners:
            try:
                await callback()
            except Exception:  # the owner's code, not only etcd calls: logged, the writer and the next callback go on
                log.exception("re-registration after a lost lease failed")

    def _answered_within(self, operation: str) -> contextlib.AbstractAsyncContextManager[None]:
        return answered_within(self.call_timeout_s, operation, self.client.endpoint)

    def _failed(self, err: EtcdError) -> None:
        """One warning per outage (at its first failure); the retries in between only at debug level."""
        error = str(err)
        if self._outage_since is None:
            self._outage_since = time.monotonic()
            log.warning("etcd lease refresh failed; retrying", extra={"etcd": self.endpoints[0], "error": error})
        else:
            log.debug("etcd lease refresh failed again", extra={"etcd": self.endpoints[0], "error": error})
