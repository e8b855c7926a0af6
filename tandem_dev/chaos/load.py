"""The chaos run's clients: temperature-0 chat streams through the routers, each recorded as a ``StreamResult``.

A client stands for a Service in front of the routers: a request that got no response at all (connection
refused, or closed before the status line: its router died) is sent to the next router, at most ``FAILOVERS``
times, as the ``openai`` SDK retries such a connection error twice by default (``max_retries=2``; the SDK retries
the same URL, the next router here stands for the Service's other endpoint). Nothing else is retried by the
client: an error status, a stream that breaks or an error event is what the user sees. One pooled ``aiohttp``
session per router.
"""

from __future__ import annotations

import asyncio
import random
import time
from collections.abc import Sequence
from dataclasses import dataclass

import aiohttp
import orjson

from tandem_dev.chaos.report import StreamResult

FAILOVERS = 2


@dataclass(frozen=True)
class LoadSpec:
    model: str
    prompts: int  # distinct prompts (each has one reference answer)
    max_tokens: int
    concurrency: int
    streams: int  # at most this many streams ...
    duration_s: float  # ... started within this time
    hang_s: float  # a stream with no event for this long is hung
    seed: int


def prompt_text(i: int) -> str:
    return f"chaos prompt {i}: tell me a long story about the sea"


def body(spec: LoadSpec, prompt: int, stream: bool) -> dict[str, object]:
    return {
        "model": spec.model,
        "messages": [{"role": "user", "content": prompt_text(prompt)}],
        "max_tokens": spec.max_tokens,
        "temperature": 0,
        "stream": stream,
    }


class _NoResponseError(Exception):
    """The router gave no response at all: the client may send the request elsewhere."""


class Routers:
    """One pooled HTTP session per router URL."""

    def __init__(self, urls: Sequence[str]) -> None:
        self.urls = list(urls)
        self.sessions = {url: aiohttp.ClientSession(timeout=aiohttp.ClientTimeout(total=None)) for url in urls}

    async def close(self) -> None:
        for session in self.sessions.values():
            await session.close()


async def reference(routers: Routers, spec: LoadSpec, prompt: int) -> str:
    """The uninterrupted answer (not streamed), asked before any fault."""
    url = routers.urls[prompt % len(routers.urls)]
    timeout = aiohttp.ClientTimeout(total=120)
    async with routers.sessions[url].post(
        f"{url}/v1/chat/completions", json=body(spec, prompt, False), timeout=timeout
    ) as resp:
        doc = await resp.json()
        if resp.status != 200:
            raise RuntimeError(f"reference for prompt {prompt}: HTTP {resp.status}: {doc}")
    return str(doc["choices"][0]["message"]["content"] or "")


async def one_stream(routers: Routers, spec: LoadSpec, prompt: int, first: int, t0: float) -> StreamResult:
    out = StreamResult(prompt=prompt, started=time.monotonic() - t0, ended=0.0)
    try:
        for attempt in range(FAILOVERS + 1):
            out.router = (first + attempt) % len(routers.urls)
            url = routers.urls[out.router]
            try:
                await _stream(routers.sessions[url], url, spec, prompt, out, t0)
                break
            except _NoResponseError as err:
                out.failovers += attempt < FAILOVERS
                out.error = f"no response: {err}"
    finally:
        out.ended = time.monotonic() - t0
    return out


async def _stream(
    session: aiohttp.ClientSession, url: str, spec: LoadSpec, prompt: int, out: StreamResult, t0: float
) -> None:
    out.error = ""
    try:
        request = session.post(f"{url}/v1/chat/completions", json=body(spec, prompt, True))
        try:
            # The router sends its status line with the first byte (it retries before that), so the wait for the
            # first byte is bounded by the hang timeout too.
            resp = await asyncio.wait_for(request, spec.hang_s)
        except TimeoutError:
            out.hung = True
            return
        except (aiohttp.ClientError, ConnectionError) as err:
            raise _NoResponseError(type(err).__name__) from err
        async with resp:
            if resp.status != 200:
                out.error = f"HTTP {resp.status}: {(await resp.read())[:200]!r}"
                return
            while True:
                try:
                    line = await asyncio.wait_for(resp.content.readline(), spec.hang_s)
                except TimeoutError:
                    out.hung = True
                    return
                if not line:
                    out.error = out.error or "stream ended without [DONE]"
                    return
                if _event(line, out, t0):
                    return
    except (aiohttp.ClientError, ConnectionError) as err:
        out.error = f"transport: {type(err).__name__}"


def _event(line: bytes, out: StreamResult, t0: float) -> bool:
    """Record one SSE line; True at the end of the stream (``[DONE]`` or an error event)."""
    if not line.startswith(b"data: "):
        return False
    data = line[6:].strip()
    if data == b"[DONE]":
        out.done = True
        return True
    doc = orjson.loads(data)
    if "error" in doc:
        out.error = f"error event: {doc['error'].get('message', '')}"
        return True
    if out.first_byte is None:
        out.first_byte = time.monotonic() - t0
    for choice in doc.get("choices", []):
        out.text += (choice.get("delta") or {}).get("content") or ""
    return False


async def run_load(routers: Routers, spec: LoadSpec, t0: float, stop: asyncio.Event) -> list[StreamResult]:
    """Streams ``spec.concurrency`` at a time until ``spec.streams`` started, ``spec.duration_s`` passed or
    ``stop`` is set; prompts and first routers drawn from ``spec.seed``."""
    rng = random.Random(spec.seed)
    results: list[StreamResult] = []
    started = 0
    deadline = t0 + spec.duration_s

    async def client() -> None:
        nonlocal started
        while started < spec.streams and time.monotonic() < deadline and not stop.is_set():
            started += 1
            prompt, first = rng.randrange(spec.prompts), rng.randrange(len(routers.urls))
            results.append(await one_stream(routers, spec, prompt, first, t0))

    await asyncio.gather(*(client() for _ in range(spec.concurrency)))
    return results
