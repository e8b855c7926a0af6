"""Leader election adapter: holds a ``coordination.k8s.io/v1`` Lease, deciding with ``tandem_operator.decide.leader``.

``acquire`` blocks until this replica holds the Lease; ``hold`` renews it every ``duration / 3`` and returns when
leadership is lost (no successful renewal for ``2/3`` of the Lease's duration -- client-go's renew deadline, so a
cut-off holder stops before a standby may take over -- or another replica took it), so the caller stops the
operator. ``release`` gives the Lease up on a clean shutdown (client-go's ReleaseOnCancel): in a rolling
update the new replica takes over at its next round (every ``retry_s``) instead of waiting out the Lease, well
before the old replica's registry entries expire with its etcd lease.
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import Callable
from datetime import UTC, datetime

from tandem_operator.act.k8s.kube import ConflictError, Kube, PermanentError
from tandem_operator.decide.leader import LeaseAction, Observed, decide, lease_body, lease_state, observe

log = logging.getLogger("tandem.operator.leader")


class LeaderElector:
    def __init__(
        self,
        kube: Kube,
        *,
        name: str,
        namespace: str,
        identity: str,
        duration_s: int = 6,
        retry_s: float = 1.0,
        clock: Callable[[], float] = time.monotonic,
        wall_clock: Callable[[], datetime] = lambda: datetime.now(UTC),
    ) -> None:
        self.kube, self.name, self.namespace, self.identity, self.duration_s = (
            kube,
            name,
            namespace,
            identity,
            duration_s,
        )
        self.retry_s = retry_s
        self.clock, self.wall_clock = clock, wall_clock  # expiry on ``clock``; ``wall_clock`` only written
        self._observed: Observed | None = None
        self.path = f"/apis/coordination.k8s.io/v1/namespaces/{namespace}/leases/{name}"

    async def try_once(self) -> bool:
        """One election round; True if this replica holds the Lease afterwards."""
        state = lease_state(await self.kube.get(self.path))
        self._observed = observe(self._observed, state, self.clock())
        action = decide(self._observed, self.identity, self.clock())
        if action is LeaseAction.WAIT:
            return False
        body = lease_body(
            name=self.name,
            namespace=self.namespace,
            me=self.identity,
            duration_s=self.duration_s,
            now=self.wall_clock(),
            action=action,
            state=state,
        )
        try:
            if action is LeaseAction.CREATE:
                await self.kube.post(f"/apis/coordination.k8s.io/v1/namespaces/{self.namespace}/leases", body)
            else:
                await self.kube.put(self.path, body)
        except ConflictError:  # another replica wrote first
            return False
        except PermanentError as err:
            if err.status != 422:  # 422: another replica created it first
                raise
            return False
        if action is not LeaseAction.RENEW:
            log.info("leadership acquired", extra={"lease": self.name, "identity": self.identity})
        return True

    async def acquire(self) -> None:
        while True:
            try:
                if await self.try_once():
                    return
            except Exception as err:
                log.warning("leader election round failed", extra={"error": repr(err)})
            await asyncio.sleep(self.retry_s)

    async def release(self) -> None:
        """Clear the holder if it is still us (resourceVersion-guarded PUT); a standby then acquires at once."""
        lease = await self.kube.get(self.path)
        spec = (lease or {}).get("spec") or {}
        if lease is None or spec.get("holderIdentity") != self.identity:
            return
        lease["spec"] = {key: value for key, value in spec.items() if key not in {"holderIdentity", "renewTime"}}
        try:
            await self.kube.put(self.path, lease)
        except ConflictError:  # someone else already wrote it; nothing left to give up
            return
        log.info("leadership released", extra={"lease": self.name, "identity": self.identity})

    async def hold(self) -> None:
        """Renew until leadership is lost; then return."""
        last_renewed = time.monotonic()
        while True:
            await asyncio.sleep(self.duration_s / 3)
            try:
                if await self.try_once():
                    last_renewed = time.monotonic()
                    continue
                log.error("leadership lost to another replica", extra={"lease": self.name})
                return
            except Exception as err:
                log.warning("lease renewal failed", extra={"error": repr(err)})
            if time.monotonic() - last_renewed >= self.duration_s * 2 / 3:
                log.error("leadership lost: could not renew the lease in time", extra={"lease": self.name})
                return
