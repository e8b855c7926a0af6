"""Reads a worker's ``/metrics`` and ``/health`` (one pooled HTTP client for every worker the operator asks)."""

from __future__ import annotations

import aiohttp

from tandem_operator.decide.drain import in_flight

TIMEOUT_S = 5.0


class WorkerMetrics:
    def __init__(self) -> None:
        self._session: aiohttp.ClientSession | None = None

    async def in_flight(self, url: str) -> int | None:
        """Work in flight on the worker at ``url``: 0 when nothing listens there (no server, nothing running),
        None when it did not answer in time or answered without the gauges."""
        try:
            async with self._client().get(url) as resp:
                if resp.status != 200:
                    return None
                return in_flight(await resp.text())
        except aiohttp.ClientConnectorError:
            return 0
        except (aiohttp.ClientError, TimeoutError):
            return None

    async def text(self, url: str) -> str | None:
        """The body ``url`` answers with 200 (a ``/metrics`` exposition); None on any other answer or none."""
        try:
            async with self._client().get(url) as resp:
                return await resp.text() if resp.status == 200 else None
        except (aiohttp.ClientError, TimeoutError):
            return None

    async def healthy(self, url: str) -> bool:
        """The worker at ``url`` answers ``/health`` with 200 (what a router's health check asks)."""
        try:
            async with self._client().get(f"{url}/health") as resp:
                return resp.status == 200
        except (aiohttp.ClientError, TimeoutError):
            return False

    def _client(self) -> aiohttp.ClientSession:
        if self._session is None:
            self._session = aiohttp.ClientSession(timeout=aiohttp.ClientTimeout(total=TIMEOUT_S))
        return self._session

    async def close(self) -> None:
        if self._session is not None:
            await self._session.close()
            self._session = None
