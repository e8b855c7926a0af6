"""Clients for the router's three streaming routes, and what each stream delivered (for the resume tests).

Every client reads the whole stream the way a user would (the ``openai`` SDK for the OpenAI routes, SSE lines for
SGLang's ``/generate``) and records what it received: per choice text, the stream ids it saw, the finish reason,
the token count, and an error event if the stream ended with one. ``reference`` asks the same request again,
not streamed: the uninterrupted answer to compare with.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

import aiohttp
import openai
import orjson

from tandem_dev.local_stack import MODEL
from tandem_router.openai.schema import Route


@dataclass
class Outcome:
    first_byte: bool = False
    ok: bool = False
    error: str = ""
    texts: dict[int, str] = field(default_factory=dict)  # choice index -> text
    ids: set[str] = field(default_factory=set)  # stream ids seen (one, unless a resume leaked a new one)
    finish_reason: str | None = None
    completion_tokens: int = -1
    output_ids: list[int] | None = None  # /generate only

    @property
    def text(self) -> str:
        return self.texts.get(0, "")

    def answer(self) -> tuple[dict[int, str], str | None, int, list[int] | None]:
        return self.texts, self.finish_reason, self.completion_tokens, self.output_ids


async def stream(
    route: Route, body: dict[str, Any], client: openai.AsyncOpenAI, http: aiohttp.ClientSession
) -> Outcome:
    """``body`` without ``model``/``stream``: what the request asks for."""
    out = Outcome()
    try:
        if route is Route.GENERATE:
            await _generate(http, f"{client.base_url}".removesuffix("/v1/"), body, out)
        else:
            await _openai(route, client, body, out)
    except openai.APIError as err:
        out.error = f"{type(err).__name__}: {err.message}"
    return out


async def _openai(route: Route, client: openai.AsyncOpenAI, body: dict[str, Any], out: Outcome) -> None:
    create: Any = client.chat.completions.create if route is Route.CHAT else client.completions.create
    chunks = await create(model=MODEL, stream=True, stream_options={"include_usage": True}, **body)
    async for chunk in chunks:
        out.first_byte = True
        out.ids.add(chunk.id)
        for choice in chunk.choices:
            piece = (choice.delta.content or "") if route is Route.CHAT else choice.text
            out.texts[choice.index] = out.texts.get(choice.index, "") + piece
            out.finish_reason = choice.finish_reason or out.finish_reason
        if chunk.usage is not None:
            out.completion_tokens = chunk.usage.completion_tokens
    out.ok = True


async def _generate(http: aiohttp.ClientSession, router_url: str, body: dict[str, Any], out: Outcome) -> None:
    async with http.post(f"{router_url}/generate", json={**body, "stream": True}) as resp:
        if resp.status != 200:
            out.error = f"HTTP {resp.status}: {await resp.text()}"
            return
        async for line in resp.content:
            if not line.startswith(b"data: "):
                continue
            if line.strip() == b"data: [DONE]":
                out.ok = not out.error
                return
            doc = orjson.loads(line[6:])
            if "error" in doc:
                out.error = str(doc["error"].get("message"))
                continue
            out.first_byte = True
            meta = doc["meta_info"]
            out.ids.add(meta["id"])
            out.texts[0], out.output_ids = doc["text"], doc["output_ids"]
            out.completion_tokens = meta["completion_tokens"]
            out.finish_reason = (meta.get("finish_reason") or {}).get("type") or out.finish_reason
    if not out.error:
        out.error = "the stream ended without [DONE]"


async def reference(
    route: Route, body: dict[str, Any], client: openai.AsyncOpenAI, http: aiohttp.ClientSession
) -> tuple[dict[int, str], str | None, int, list[int] | None]:
    """The uninterrupted answer: the same request, not streamed."""
    if route is Route.GENERATE:
        url = f"{client.base_url}".removesuffix("/v1/")
        async with http.post(f"{url}/generate", json=body) as resp:
            assert resp.status == 200, await resp.text()
            doc = await resp.json()
        meta = doc["meta_info"]
        return {0: doc["text"]}, meta["finish_reason"]["type"], meta["completion_tokens"], doc["output_ids"]
    if route is Route.CHAT:
        chat = await client.chat.completions.create(model=MODEL, **body)
        assert chat.usage is not None
        choices = {c.index: c.message.content or "" for c in chat.choices}
        return choices, chat.choices[-1].finish_reason, chat.usage.completion_tokens, None
    done = await client.completions.create(model=MODEL, **body)
    assert done.usage is not None
    return {c.index: c.text for c in done.choices}, done.choices[-1].finish_reason, done.usage.completion_tokens, None
