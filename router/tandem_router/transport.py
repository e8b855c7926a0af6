"""The one way the router talks to workers: a pooled aiohttp session per worker, and a small error tree.

    WorkerError                 the worker could not be reached or broke the exchange (retryable before byte 1)
      +-- WorkerUnreachableError     nothing listens / connection refused: the worker is down, open its breaker now

Keeping each worker's connections in its own session (own connector, keep-alive pool) means a slow or dead
worker cannot exhaust the connections of the others, and dropping a worker closes exactly its sockets.
"""

from __future__ import annotations

import asyncio
from collections.abc import Mapping
from dataclasses import dataclass

import aiohttp

JSON_HEADERS = {"Content-Type": "application/json"}


class WorkerError(Exception):
    """Transport failure talking to a worker."""


class WorkerUnreachableError(WorkerError):
    """Connection refused or no route: the worker is not there."""


@dataclass(frozen=True)
class TransportConfig:
    connect_timeout: float = 2.0
    read_idle_timeout: float = 300.0  # longest silence between two bytes of a worker's response
    probe_timeout: float = 5.0
    connections_per_worker: int = 0  # 0: unbounded


class Transport:
    def __init__(self, cfg: TransportConfig | None = None) -> None:
        self.cfg = cfg or TransportConfig()
        self._sessions: dict[str, aiohttp.ClientSession] = {}
        self._timeout = aiohttp.ClientTimeout(
            total=None, sock_connect=self.cfg.connect_timeout, sock_read=self.cfg.read_idle_timeout
        )

    def session(self, base_url: str) -> aiohttp.ClientSession:
        s = self._sessions.get(base_url)
        if s is None or s.closed:
            connector = aiohttp.TCPConnector(
                limit=self.cfg.connections_per_worker, limit_per_host=0, keepalive_timeout=30, ttl_dns_cache=60
            )
            s = aiohttp.ClientSession(
                base_url=base_url,
                connector=connector,
                timeout=self._timeout,
                auto_decompress=False,
                cookie_jar=aiohttp.DummyCookieJar(),
                skip_auto_headers=("User-Agent", "Accept-Encoding"),
            )
            self._sessions[base_url] = s
        return s

    async def open_post(
        self, base_url: str, path: str, body: bytes, headers: Mapping[str, str]
    ) -> aiohttp.ClientResponse:
        """POST and return once the response head arrived; the caller reads the body and releases it."""
        try:
            return await self.session(base_url).post(path, data=body, headers=headers, allow_redirects=False)
        except aiohttp.ClientConnectorError as err:
            raise WorkerUnreachableError(f"{base_url}: {err.os_error or err}") from err
        except (TimeoutError, aiohttp.ClientError, OSError) as err:
            raise WorkerError(f"{base_url}{path}: {type(err).__name__}: {err}") from err

    async def get(self, base_url: str, path: str, probe_timeout: float | None = None) -> tuple[int, bytes]:
        """A short GET (health probe, /metrics, /v1/models): status and body."""
        t = aiohttp.ClientTimeout(total=probe_timeout or self.cfg.probe_timeout)
        try:
            async with self.session(base_url).get(path, timeout=t) as resp:
                return resp.status, await resp.read()
        except aiohttp.ClientConnectorError as err:
            raise WorkerUnreachableError(f"{base_url}: {err.os_error or err}") from err
        except (TimeoutError, aiohttp.ClientError, OSError) as err:
            raise WorkerError(f"{base_url}{path}: {type(err).__name__}: {err}") from err

    async def forget(self, base_url: str) -> None:
        s = self._sessions.pop(base_url, None)
        if s is not None:
            await s.close()

    async def close(self) -> None:
        sessions, self._sessions = list(self._sessions.values()), {}
        await asyncio.gather(*(s.close() for s in sessions), return_exceptions=True)
