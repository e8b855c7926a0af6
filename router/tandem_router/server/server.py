"""The router's HTTP/1.1 server: listening (``listener``: every waiting connection accepted at once), the
connections' deadlines, graceful shutdown.

``stop_listening`` closes the listener (new connections are refused) and closes idle keep-alive connections;
``drain`` then lets the requests being answered finish for up to its timeout (each connection closes after its
response, ``Connection: close``), and cancels what is left.
"""

from __future__ import annotations

import asyncio
import contextlib
import time

from tandem_router.server.listener import Listener, bind
from tandem_router.server.protocol import Handler, Limits, ServerConnection, Site

_SWEEP_S = 1.0


class HttpServer:
    def __init__(self, handler: Handler, limits: Limits) -> None:
        self.site = Site(handler, limits)
        self._listener: Listener | None = None
        self._sweeper: asyncio.Task[None] | None = None

    async def start(self, host: str, port: int, *, reuse_port: bool = False, backlog: int = 4096) -> None:
        sockets = bind(host, port, reuse_port=reuse_port, backlog=backlog)
        self._listener = Listener(sockets, lambda: ServerConnection(self.site))
        self._sweeper = asyncio.create_task(self._sweep())

    @property
    def address(self) -> tuple[str, int]:
        assert self._listener is not None
        host, port = self._listener.sockets[0].getsockname()[:2]
        return str(host), int(port)

    async def _sweep(self) -> None:
        while True:
            await asyncio.sleep(_SWEEP_S)
            now = time.monotonic()
            for conn in list(self.site.connections):
                if conn.deadline and now > conn.deadline:
                    conn.expire()

    def stop_listening(self) -> None:
        self.site.draining = True
        if self._listener is not None:
            self._listener.close()
        for conn in list(self.site.connections):
            if conn.idle:
                conn.close()

    async def drain(self, grace_s: float) -> None:
        """Wait for the requests being answered (at most ``grace_s``), then close every connection."""
        self.stop_listening()
        site = self.site
        with contextlib.suppress(TimeoutError):
            async with asyncio.timeout(grace_s):
                while any(not conn.idle for conn in site.connections):
                    site.settled.clear()
                    await site.settled.wait()
        for conn in list(self.site.connections):
            if conn.task is not None:
                conn.task.cancel()
            conn.close()
        if self._sweeper is not None:
            self._sweeper.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await self._sweeper
        await asyncio.sleep(0)  # let the closed connections' connection_lost run
