"""The router's listening sockets, accepted by us: every connection waiting in the accept queue is taken at each
readiness, however busy the event loop is.

libuv (under uvloop) accepts one connection per loop iteration since 1.45 (libuv/libuv#3696, "unix: don't
accept() connections in a loop"), relying on level-triggered polling for the next. On a loop saturated with
streams an iteration takes tens of milliseconds, so a burst of clients waits in the kernel's accept queue for
seconds: measured on this project's machine, a uvloop server with a busy loop accepted 400 of 1,000 connections in
20 s, and the router at 1,000 wrk connections held ~1,000 of them unaccepted for the whole run (p99 5.4 s while
every accepted request was answered within 1 s; issue #42). Accepting in a loop (as asyncio's own selector loop
does, up to ``backlog`` per readiness) takes them all in one iteration; each socket then becomes a transport of
the running loop (``connect_accepted_socket``).
"""

from __future__ import annotations

import asyncio
import logging
import socket
from collections.abc import Callable

log = logging.getLogger("tandem.router.server")

ACCEPT_BATCH = 1024  # connections taken per readiness at most: the loop's other work goes on between batches
RETRY_S = 1.0  # out of file descriptors or memory: stop accepting this long (asyncio's ACCEPT_RETRY_DELAY)


def bind(host: str, port: int, *, reuse_port: bool, backlog: int) -> list[socket.socket]:
    """Listening sockets for every address ``host`` resolves to (as ``loop.create_server``)."""
    infos = socket.getaddrinfo(host or None, port, type=socket.SOCK_STREAM, flags=socket.AI_PASSIVE)
    sockets: list[socket.socket] = []
    try:
        for family, kind, proto, _, address in dict.fromkeys(infos):
            sock = socket.socket(family, kind, proto)
            sockets.append(sock)
            sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
            if reuse_port:
                sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEPORT, 1)
            if family == socket.AF_INET6:
                sock.setsockopt(socket.IPPROTO_IPV6, socket.IPV6_V6ONLY, 1)  # each family its own socket
            sock.bind(address)
            sock.listen(backlog)
            sock.setblocking(False)
    except OSError:
        for sock in sockets:
            sock.close()
        raise
    return sockets


class Listener:
    """Accepts on ``sockets`` until ``close``; each connection gets a protocol from ``factory``."""

    def __init__(self, sockets: list[socket.socket], factory: Callable[[], asyncio.Protocol]) -> None:
        self.sockets = sockets
        self._factory = factory
        self._loop = asyncio.get_running_loop()
        self._tasks: set[asyncio.Task[object]] = set()
        self._closed = False
        for sock in sockets:
            self._loop.add_reader(sock.fileno(), self._accept, sock)

    def _accept(self, listening: socket.socket) -> None:
        for _ in range(ACCEPT_BATCH):
            try:
                conn, _ = listening.accept()
            except (BlockingIOError, InterruptedError):
                return
            except ConnectionAbortedError:
                continue  # the client gave up while queued
            except OSError as err:  # out of descriptors or memory (EMFILE, ENFILE, ENOBUFS, ENOMEM), or worse
                log.error(f"cannot accept connections ({err.strerror}): retrying in {RETRY_S:g} s")
                self._loop.remove_reader(listening.fileno())
                self._loop.call_later(RETRY_S, self._resume, listening)
                return
            conn.setblocking(False)
            conn.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)  # as asyncio's transports set it
            task = self._loop.create_task(self._attach(conn))
            self._tasks.add(task)
            task.add_done_callback(self._tasks.discard)

    async def _attach(self, conn: socket.socket) -> None:
        try:
            await self._loop.connect_accepted_socket(self._factory, conn)
        except OSError:
            conn.close()  # reset before its transport existed: nothing was read from it

    def _resume(self, listening: socket.socket) -> None:
        if not self._closed:
            self._loop.add_reader(listening.fileno(), self._accept, listening)

    def close(self) -> None:
        """Stop listening: new connections are refused; accepted ones are left to their protocols."""
        if self._closed:
            return
        self._closed = True
        for sock in self.sockets:
            self._loop.remove_reader(sock.fileno())
            sock.close()
