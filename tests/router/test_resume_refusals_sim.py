"""Streams the router does not resume end cleanly, never garbled: kill a decode under ``n`` > 1 and tool-calling
streams (real simulated workers, real Mooncake).

Each stream either completes equal to the uninterrupted reference (it was not on the victim), or ends with the
OpenAI error event that names why it was not resumed (``resume.MANY_CHOICES``, ``resume.TOOLS``), after text
that is, choice by choice, a prefix of the reference. Resumable streams cut by the same kill are resumed and
complete equal to the reference. The router counts each refusal under its route and reason
(``tandem_router_resume_refused_total``).
"""

from __future__ import annotations

import asyncio
import signal
from pathlib import Path
from typing import Any

import aiohttp
import openai
import pytest

from tandem.registry import Role
from tandem_dev.local_stack import LocalStack
from tandem_dev.stack_fixture import running_stack
from tandem_router.openai.schema import Route
from tandem_router.resume import MANY_CHOICES, TOOLS, Refusal
from tests.plumbing.routermetrics import scrape
from tests.router.streams import Outcome, reference, stream
from tests.router.test_chaos_sim import FAST_PD_ENV, slow_sim

pytestmark = [pytest.mark.netns, pytest.mark.timeout(300)]  # about 20 s alone; CI shares 2 cores

PER_KIND = 6
MAX_TOKENS = 300  # 4.5 s per stream at 15 ms per token: all of them stream at once
# The kill waits for most streams to be past their first byte (so about half of each kind is cut on the victim).
STREAMING = 4 * PER_KIND
TOOL = {"type": "function", "function": {"name": "tell", "parameters": {"type": "object"}}}


def _kinds(i: int) -> list[tuple[Route, dict[str, Any], Refusal | None]]:
    chat = {"messages": [{"role": "user", "content": f"request {i}: a story"}], "max_tokens": MAX_TOKENS,
            "temperature": 0}  # fmt: skip
    return [
        (Route.CHAT, {**chat, "n": 2}, MANY_CHOICES),
        (Route.COMPLETIONS, {"prompt": f"request {i}: once", "max_tokens": MAX_TOKENS, "temperature": 0, "n": 2},
         MANY_CHOICES),
        (Route.CHAT, {**chat, "tools": [TOOL], "tool_choice": "auto"}, TOOLS),
        (Route.CHAT, {**chat, "tools": [TOOL], "tool_choice": "required"}, TOOLS),
        (Route.CHAT, chat, None),  # resumable
    ]  # fmt: skip


def test_refused_streams_end_with_the_reason_and_resumable_ones_resume(tmp_path: Path) -> None:
    with running_stack(
        tmp_path, router_port=0, worker_argv=slow_sim, restart=False, deregister_dead=False, worker_env=FAST_PD_ENV,
        router_args=["--retry-max-attempts", "6", "--policy", "round_robin"],
    ) as stack:  # fmt: skip
        asyncio.run(_scenario(stack))


async def _scenario(stack: LocalStack) -> None:
    client = openai.AsyncOpenAI(base_url=f"{stack.router_url}/v1", api_key="none", max_retries=0, timeout=60)
    try:
        async with aiohttp.ClientSession(timeout=aiohttp.ClientTimeout(total=60)) as http:
            await _kill_under_load(stack, client, http)
    finally:
        await client.close()


async def _kill_under_load(stack: LocalStack, client: openai.AsyncOpenAI, http: aiohttp.ClientSession) -> None:
    victim = next(w for w in stack.workers if w.role is Role.DECODE)
    requests = [kind for i in range(PER_KIND) for kind in _kinds(i)]

    async def one(n: int, route: Route, body: dict[str, Any]) -> Outcome:
        await asyncio.sleep(n * 0.02)
        return await asyncio.wait_for(stream(route, body, client, http), 90)

    before = await scrape(stack.router_url)
    tasks = [asyncio.create_task(one(n, route, body)) for n, (route, body, _) in enumerate(requests)]
    while (metrics := await scrape(stack.router_url)).streaming < STREAMING or metrics.in_flight[
        victim.url
    ] < STREAMING // 3:
        if all(t.done() for t in tasks):
            errors = [o.error for o in await asyncio.gather(*tasks) if o.error]
            raise AssertionError(f"all requests ended before the router showed streams on the victim: {errors}")
        await asyncio.sleep(0.05)
    victim.proc.signal(signal.SIGKILL)
    outcomes = await asyncio.gather(*tasks)
    after = await scrape(stack.router_url)
    references = await asyncio.gather(*(reference(route, body, client, http) for route, body, _ in requests))

    for n, (out, want, (route, _, refusal)) in enumerate(zip(outcomes, references, requests, strict=True)):
        if out.ok or refusal is None:
            assert out.answer() == want, (n, route, out.error)
            continue
        assert f"not resumed: {refusal.why}" in out.error, (n, out.error)
        for index, text in out.texts.items():
            assert want[0][index].startswith(text), (n, index, text)  # what was sent is the answer's beginning
    refused = after.refused - before.refused
    print(f"\nrefused by (route, reason): {dict(refused)}; resumed: {dict(after.resumed - before.resumed)}")
    assert sum(refused[route.value, MANY_CHOICES.code] for route in (Route.CHAT, Route.COMPLETIONS)) >= 1
    assert refused[Route.CHAT.value, TOOLS.code] >= 1
    assert sum(refused.values()) == after.stream_errors - before.stream_errors
