"""``tandem router``: load settings, serve on uvloop, drain on SIGTERM.

``--workers N`` forks N router processes that share the port with SO_REUSEPORT (the kernel spreads connections);
each has its own pool, health checks and metrics registry.

Once serving, a process freezes what start-up built (``gc.freeze``: the settings, tables, compiled models and pools
live as long as the process, so a full collection need not walk them again) and collects its youngest generation
every 50,000 net allocations instead of CPython's 700 (``GC_THRESHOLDS``). What a relay allocates, reference counting
frees; but with many requests in flight the count of live objects passes 700 again and again, and each collection
walks them all for almost nothing to collect (321 young and 2 full collections over ~12,500 streams at 64
connections; what that cost at 256 connections: router/README.md). Garbage that only the cycle collector can free
waits for at most 50,000 allocations, a few MB.
"""

from __future__ import annotations

import asyncio
import contextlib
import errno
import gc
import logging
import os
import signal
import sys
from collections.abc import Sequence

import pydantic
import uvloop

from tandem import logs
from tandem_router.app import build_app
from tandem_router.config import RouterSettings, load
from tandem_router.flow.limits import LimitsError, load_limits

log = logging.getLogger("tandem.router")

GC_THRESHOLDS = (50_000, 50, 100)  # young generation, then how many of each before the next one is collected


class ListenError(Exception):
    """The router cannot listen where its settings say: one line naming the setting."""


async def serve(settings: RouterSettings, *, reuse_port: bool = False) -> None:
    app = build_app(settings)
    try:
        server = await app.start(settings.host, settings.port, reuse_port=reuse_port)
    except OSError as err:
        why = "is in use" if err.errno == errno.EADDRINUSE else f"cannot be used ({err.strerror})"
        raise ListenError(f"{settings.host}:{settings.port} {why}: choose another --port (or --host)") from err
    gc.collect()
    gc.freeze()  # what start-up built lives as long as the process
    gc.set_threshold(*GC_THRESHOLDS)
    stop = asyncio.Event()
    loop = asyncio.get_running_loop()
    for sig in (signal.SIGTERM, signal.SIGINT):
        loop.add_signal_handler(sig, stop.set)
    log.info(
        "router listening",
        extra={
            "host": settings.host,
            "port": settings.port,
            "pid": os.getpid(),
            "policy": settings.policy.value,
            "discovery": settings.discovery.value,
        },
    )
    await stop.wait()
    log.info("draining", extra={"timeout_s": settings.drain_timeout_s})
    await app.stop(server, settings.drain_timeout_s)
    log.info("stopped")


def _run(settings: RouterSettings, reuse_port: bool) -> int:
    with asyncio.Runner(loop_factory=uvloop.new_event_loop) as runner:
        try:
            runner.run(serve(settings, reuse_port=reuse_port))
        except ListenError as err:
            print(f"tandem router: {err}", file=sys.stderr)
            return 2
    return 0


def main(argv: Sequence[str]) -> int:
    try:
        settings = load(argv)
    except pydantic.ValidationError as err:
        print(f"tandem router: invalid configuration:\n{err}", file=sys.stderr)
        return 2
    if settings.flow_control.enabled and settings.flow_control.limits_file is not None:
        try:
            load_limits(settings.flow_control.limits_file)
        except LimitsError as err:
            print(f"tandem router: --flow-limits-file: {err}", file=sys.stderr)
            return 2
    logs.setup(settings.log_level, "tandem.router")
    if settings.discovery.value == "static" and not (settings.prefill and settings.decode):
        print("tandem router: static discovery needs at least one --prefill and one --decode", file=sys.stderr)
        return 2
    if settings.workers == 1:
        return _run(settings, reuse_port=False)
    children: list[int] = []
    for _ in range(settings.workers):
        pid = os.fork()
        if pid == 0:
            os._exit(_run(settings, reuse_port=True))
        children.append(pid)

    def forward(sig: int, _frame: object) -> None:
        for child in children:
            with contextlib.suppress(ProcessLookupError):
                os.kill(child, sig)

    signal.signal(signal.SIGTERM, forward)
    signal.signal(signal.SIGINT, forward)
    code = 0
    for child in children:
        _, status = os.waitpid(child, 0)
        code = code or os.waitstatus_to_exitcode(status)
    return code
