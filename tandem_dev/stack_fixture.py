"""``LocalStack`` run in a background thread with its own event loop, for tests (sync or async) to use."""

from __future__ import annotations

import asyncio
import threading
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any

from tandem_dev.local_stack import LocalStack


@contextmanager
def running_stack(workdir: Path, timeout: float = 180.0, **kwargs: Any) -> Iterator[LocalStack]:
    """Start a ``LocalStack(workdir, **kwargs)`` with its supervisor; stop it all on exit."""
    stack = LocalStack(workdir, say=lambda _msg: None, **kwargs)
    loop = asyncio.new_event_loop()
    stop = asyncio.Event()
    ready = threading.Event()
    failure: list[BaseException] = []

    async def main() -> None:
        try:
            await stack.start()
        except BaseException as err:
            failure.append(err)
            ready.set()
            await stack.stop()
            return
        ready.set()
        try:
            await stack.supervise(stop)
        finally:
            await stack.stop()

    thread = threading.Thread(target=loop.run_until_complete, args=(main(),), name="local-stack", daemon=True)
    thread.start()
    try:
        if not ready.wait(timeout):
            raise TimeoutError(f"local stack not ready after {timeout}s")
        if failure:
            raise failure[0]
        yield stack
    finally:
        loop.call_soon_threadsafe(stop.set)
        thread.join(60)
        loop.close()
