"""Watches one PD cluster's integrity reports in etcd (thin adapter; deciding is ``tandem_operator.integrity``).

Lists ``integrity_prefix(namespace, cluster)``, then watches it from the next revision; a PUT upserts a report, a
DELETE -- a router removed it, or its lease expired -- drops it. Every change calls ``on_change`` with the whole
current set (etcd key -> report). After a lost connection it re-lists, so the set converges to etcd's content.
A malformed report is logged and left out.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
from collections.abc import Awaitable, Callable, Sequence
from typing import Any

import pydantic

from tandem import registry
from tandem.registry import IntegrityReport
from tandem.registry_etcd import client as etcd_client

log = logging.getLogger("tandem.operator.integrity")

OnChange = Callable[[dict[str, IntegrityReport]], Awaitable[None]]


class IntegrityWatcher:
    def __init__(
        self, endpoints: Sequence[str], namespace: str, cluster: str, on_change: OnChange, retry_s: float = 1.0
    ) -> None:
        self.endpoints = tuple(endpoints)
        self.prefix = registry.integrity_prefix(namespace, cluster).encode()
        self.on_change, self.retry_s = on_change, retry_s
        self._task: asyncio.Task[None] | None = None

    def start(self) -> None:
        self._task = asyncio.create_task(self._run(), name=f"integrity-watch-{self.prefix.decode()}")

    async def stop(self) -> None:
        if self._task is not None:
            self._task.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await self._task

    async def _run(self) -> None:
        while True:
            etcd = etcd_client(self.endpoints)
            try:
                await etcd.connect()
                await self._list_and_watch(etcd)
            except asyncio.CancelledError:
                raise
            except Exception as err:
                log.warning("integrity watch lost; re-listing", extra={"error": repr(err)})
            finally:
                with contextlib.suppress(Exception):
                    await etcd.close()
            await asyncio.sleep(self.retry_s)

    async def _list_and_watch(self, etcd: Any) -> None:
        listing = await etcd.get_prefix(self.prefix)
        reports: dict[str, IntegrityReport] = {}
        for kv in listing:
            report = _parse(kv.key, kv.value)
            if report is not None:
                reports[kv.key.decode()] = report
        await self.on_change(dict(reports))
        async for event in await etcd.watch_prefix(self.prefix, start_revision=listing.header.revision + 1):
            key = event.kv.key.decode()
            report = None if event.kind == "DELETE" else _parse(event.kv.key, event.kv.value)
            if report is None:
                reports.pop(key, None)
            else:
                reports[key] = report
            await self.on_change(dict(reports))


def _parse(key: bytes, value: bytes) -> IntegrityReport | None:
    try:
        return IntegrityReport.model_validate_json(value)
    except pydantic.ValidationError as err:
        log.error("malformed integrity report skipped", extra={"key": key.decode(errors="replace"), "error": str(err)})
        return None
