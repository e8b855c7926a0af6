"""List, then watch, the objects of a collection that match a label selector (client-go's reflector, reduced).

A listing hands every matching object to ``resync`` (the caller's state becomes exactly that), then a watch from
the listing's resourceVersion hands each change to ``apply(type, object)`` (``ADDED``, ``MODIFIED``, ``DELETED``).
The watch asks for bookmarks, which carry nothing but a newer resourceVersion: when the server ends a watch (its
``timeoutSeconds``), the next one starts from the last version seen, which no change can have slipped past. Any
other end is a gap in which changes may have been missed (a DELETED event will never come for a pod deleted then):
a ``410 Gone`` (the version was compacted away; as a status or an ``ERROR`` event) re-lists at once; a dropped
connection or any other error re-lists after a back-off that doubles from ``retry_s`` up to ``max_retry_s``.
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import AsyncIterator, Callable
from typing import Any, NoReturn, Protocol

from tandem.kube.rest import ApiError, Request

WATCH_TIMEOUT_S = 300  # the server ends a watch after this (a bookmark-fresh resume follows)
RETRY_S = 1.0
MAX_RETRY_S = 10.0
GONE = 410

log = logging.getLogger("tandem.kube.watch")

Resync = Callable[[list[dict[str, Any]]], None]
Apply = Callable[[str, dict[str, Any]], None]


class Streamer(Protocol):
    """What sends requests and streams answers (``tandem.kube.rest.RestClient``)."""

    async def send(self, request: Request) -> Any: ...

    def lines(self, request: Request, *, timeout_s: float) -> AsyncIterator[Any]: ...


async def list_objects(rest: Streamer, path: str, selector: str) -> tuple[list[dict[str, Any]], str]:
    """The matching objects and the listing's resourceVersion, to watch from."""
    listing = await rest.send(Request("GET", path, (("labelSelector", selector),), {}, None))
    return list(listing.get("items") or []), str(listing["metadata"]["resourceVersion"])


async def watch_objects(
    rest: Streamer, path: str, selector: str, version: str, apply: Apply, timeout_s: int = WATCH_TIMEOUT_S
) -> str:
    """Hand each change after ``version`` to ``apply`` until the server ends the watch; the last version seen.
    Raises ``ApiError`` for an ``ERROR`` event (``status`` 410 when ``version`` is too old)."""
    query = (
        ("labelSelector", selector),
        ("watch", "1"),
        ("resourceVersion", version),
        ("allowWatchBookmarks", "true"),
        ("timeoutSeconds", str(timeout_s)),
    )
    async for event in rest.lines(Request("GET", path, query, {}, None), timeout_s=timeout_s + 30):
        kind, obj = str(event.get("type")), event.get("object") or {}
        if kind == "ERROR":  # a Status object
            raise ApiError(int(obj.get("code") or 500), str(obj.get("reason") or ""), str(obj.get("message") or ""))
        version = str((obj.get("metadata") or {}).get("resourceVersion") or version)
        if kind != "BOOKMARK":
            apply(kind, obj)
    return version


async def list_then_watch(
    rest: Streamer,
    path: str,
    selector: str,
    *,
    resync: Resync,
    apply: Apply,
    watch_timeout_s: int = WATCH_TIMEOUT_S,
    retry_s: float = RETRY_S,
    max_retry_s: float = MAX_RETRY_S,
) -> NoReturn:
    """List, then watch, for ever (until cancelled); see the module's docstring."""
    delay = retry_s
    while True:
        try:
            items, version = await list_objects(rest, path, selector)
            resync(items)
            delay = retry_s
            while True:
                version = await watch_objects(rest, path, selector, version, apply, watch_timeout_s)
        except ApiError as err:
            if err.status == GONE:
                log.info("watch version expired; re-listing", extra={"path": path, "selector": selector})
                continue
            error: Exception = err
        except Exception as err:  # a dropped connection, a timeout, a malformed answer: all mean a gap
            error = err
        log.warning(
            "watch failed; re-listing",
            extra={"path": path, "selector": selector, "error": repr(error), "retry_s": delay},
        )
        await asyncio.sleep(delay)
        delay = min(delay * 2, max_retry_s)
