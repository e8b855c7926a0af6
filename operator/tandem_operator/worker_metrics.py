"""Reads a worker's ``/metrics`` (one pooled HTTP client for every worker the operator drains)."""

from __future__ import annotations

import aiohttp

from tandem_operator.drain import in_flight

TIMEOUT_S = 5.0


class WorkerMetrics:
    def __init__(self) -> None:
        self._session: aiohttp.ClientSession | None = None

    async def in_flight(self, url: str) -> int | None:
        """Work in flight on the worker at ``url``: 0 when nothing listens there (no server, nothing running),
        None when it did not answer in time or answered without the gauges."""
        if self._session is None:
            self._session = aiohttp.ClientSession(timeout=aiohttp.ClientTimeout(total=TIMEOUT_S))
        try:
            async with self._session.get(url) as resp:
                if resp.status != 200:
                    return None
                return in_flight(await resp.text())
        except aiohttp.ClientConnectorError:
            return 0
        except (aiohttp.ClientError, TimeoutError):
            return None

    async def close(self) -> None:
        if self._session is not None:
            await self._session.close()
            self._session = None
