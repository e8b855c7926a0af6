"""``tandem.kube.watch`` against a local API server stand-in: a watch's line-delimited events (split anywhere by
the transport, larger than aiohttp's line buffer), bookmarks, a server-ended watch resumed from the last version
without a listing, and a re-listing after ``410 Gone`` (at once) or a dropped connection (after the back-off)."""

from __future__ import annotations

import asyncio
import json
from collections.abc import AsyncIterator, Callable
from dataclasses import dataclass, field
from typing import Any

import pytest
from aiohttp import web

from tandem.kube.credentials import Credentials
from tandem.kube.rest import RestClient
from tandem.kube.watch import list_then_watch
from tandem_dev.procs import free_port

PATH = "/api/v1/namespaces/ns/pods"
Answer = Callable[[web.Request], Any]


def pod(name: str, version: str, padding: int = 0) -> dict[str, Any]:
    return {"metadata": {"name": name, "resourceVersion": version, "annotations": {"pad": "x" * padding}}}


def event(kind: str, obj: dict[str, Any]) -> bytes:
    return json.dumps({"type": kind, "object": obj}).encode() + b"\n"


@dataclass
class ApiServer:
    """Answers a listing with ``listing`` and each watch with the next of ``watches`` (then holds it open)."""

    url: str = ""
    listing: list[dict[str, Any]] = field(default_factory=list)
    watches: list[Answer] = field(default_factory=list)
    requests: list[dict[str, str]] = field(default_factory=list)
    version: int = 10

    async def handle(self, request: web.Request) -> web.StreamResponse:
        self.requests.append(dict(request.query))
        if "watch" not in request.query:
            self.version += 1
            return web.json_response({"items": self.listing, "metadata": {"resourceVersion": str(self.version)}})
        if not self.watches:
            await asyncio.sleep(3600)
        answer: web.StreamResponse = await self.watches.pop(0)(request)
        return answer


async def stream(request: web.Request, chunks: list[bytes], *, drop: bool = False) -> web.StreamResponse:
    response = web.StreamResponse()
    response.enable_chunked_encoding()
    await response.prepare(request)
    for chunk in chunks:
        await response.write(chunk)
        await asyncio.sleep(0.01)
    if drop:  # the connection lost mid-stream: no final chunk
        assert request.transport is not None
        request.transport.abort()
        return response
    await response.write_eof()
    return response


@pytest.fixture
async def api() -> AsyncIterator[ApiServer]:
    port = free_port()
    server = ApiServer(url=f"http://127.0.0.1:{port}")
    app = web.Application()
    app.router.add_get(PATH, server.handle)
    runner = web.AppRunner(app, access_log=None, shutdown_timeout=0.1)  # a held watch ends at once
    await runner.setup()
    await web.TCPSite(runner, "127.0.0.1", port).start()
    yield server
    await runner.cleanup()


class Seen:
    def __init__(self) -> None:
        self.listings: list[list[str]] = []
        self.events: list[tuple[str, str]] = []

    def resync(self, items: list[dict[str, Any]]) -> None:
        self.listings.append([item["metadata"]["name"] for item in items])

    def apply(self, kind: str, obj: dict[str, Any]) -> None:
        self.events.append((kind, obj["metadata"]["name"]))

    @staticmethod
    async def until(check: Callable[[], bool], within: float = 5.0) -> None:
        async with asyncio.timeout(within):
            while True:  # polled: the server's requests are counted too, not only the callbacks
                if check():
                    return
                await asyncio.sleep(0.01)


@pytest.fixture
async def watching(api: ApiServer) -> AsyncIterator[tuple[ApiServer, Seen, Callable[..., None]]]:
    seen, tasks = Seen(), []
    async with RestClient(Credentials(server=api.url)) as rest:

        def start(**options: Any) -> None:
            run = list_then_watch(rest, PATH, "app=w", resync=seen.resync, apply=seen.apply, **options)
            tasks.append(asyncio.create_task(run))

        yield api, seen, start
        for task in tasks:
            task.cancel()
        await asyncio.gather(*tasks, return_exceptions=True)


async def test_events_split_anywhere_and_larger_than_a_line_buffer_are_parsed(
    watching: tuple[ApiServer, Seen, Callable[..., None]],
) -> None:
    api, seen, start = watching
    api.listing = [pod("a", "5")]
    big = event("ADDED", pod("big", "12", padding=300_000))  # > aiohttp's 128 KiB readline limit
    body = event("MODIFIED", pod("a", "11")) + big + b"\n" + event("DELETED", pod("a", "13"))
    chunks = [body[i : i + 7000] for i in range(0, len(body), 7000)]
    api.watches = [lambda request: stream(request, chunks)]
    start()
    await seen.until(lambda: len(seen.events) == 3)
    assert seen.listings == [["a"]]
    assert seen.events == [("MODIFIED", "a"), ("ADDED", "big"), ("DELETED", "a")]
    watch = api.requests[1]
    assert watch == {
        "labelSelector": "app=w",
        "watch": "1",
        "resourceVersion": "11",
        "allowWatchBookmarks": "true",
        "timeoutSeconds": "300",
    }


async def test_a_server_ended_watch_resumes_from_the_last_bookmark_without_a_listing(
    watching: tuple[ApiServer, Seen, Callable[..., None]],
) -> None:
    api, seen, start = watching
    bookmark = {"kind": "Pod", "metadata": {"resourceVersion": "40"}}
    api.watches = [lambda request: stream(request, [event("ADDED", pod("a", "30")), event("BOOKMARK", bookmark)])]
    start()
    await seen.until(lambda: len(api.requests) == 3)
    assert seen.events == [("ADDED", "a")]  # the bookmark is no change
    assert [r.get("resourceVersion") for r in api.requests] == [None, "11", "40"]
    assert len(seen.listings) == 1


@pytest.mark.parametrize("gone", ["event", "status"])
async def test_410_gone_relists_at_once(watching: tuple[ApiServer, Seen, Callable[..., None]], gone: str) -> None:
    api, seen, start = watching
    status = {"kind": "Status", "code": 410, "reason": "Expired", "message": "too old resource version: 11 (20)"}

    async def expired(request: web.Request) -> web.StreamResponse:
        if gone == "status":
            return web.json_response(status, status=410)
        return await stream(request, [event("ERROR", status)])

    api.listing = [pod("a", "5")]
    api.watches = [expired]
    start(retry_s=60.0)  # a back-off would outlast the test
    await seen.until(lambda: len(api.requests) == 4)
    assert [r.get("resourceVersion") for r in api.requests] == [None, "11", None, "12"]
    assert len(seen.listings) == 2


async def test_a_dropped_connection_relists_after_the_back_off(
    watching: tuple[ApiServer, Seen, Callable[..., None]],
) -> None:
    api, seen, start = watching
    api.listing = [pod("a", "5")]
    api.watches = [lambda request: stream(request, [event("ADDED", pod("b", "12"))], drop=True)]
    start(retry_s=0.3)
    await seen.until(lambda: seen.events == [("ADDED", "b")])
    loop = asyncio.get_running_loop()
    dropped = loop.time()
    await seen.until(lambda: len(seen.listings) == 2)
    assert loop.time() - dropped >= 0.25
    assert seen.listings == [["a"], ["a"]]
