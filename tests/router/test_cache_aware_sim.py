"""Cache-aware routing end to end: a tiny version of ``tandem bench prefix``'s multi-turn chat through the router
(default policy, ``cache_aware``) over two simulated prefills and one decode (real PD protocol, Mooncake KV).

Which prefill served a request is read from the prefills' own ``sglang:prompt_tokens_total``; cache hits from
their ``sglang:cached_tokens_total``. Not timed: the assertions are about where requests went. The router runs
with ``--no-integrity`` so that no canary or shadow request adds to the prefills' counters.
"""

from __future__ import annotations

import asyncio
import sys
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

import aiohttp
import pytest

from tandem_dev.procs import ManagedProcess, free_port
from tandem_dev.router.bench_e2e import stream_ttft
from tandem_dev.router.bench_prefix import chat_body, prefill_counters
from tandem_dev.router.prefix_workload import Conversation, messages, workload
from tandem_dev.sim.testing import HOST, SimWorker, start_decode, start_prefill

pytestmark = [pytest.mark.netns, pytest.mark.timeout(240)]

SIM_MODEL = "sim/model"  # tandem_dev.sim.testing's --model-path
PREFILL_MS_PER_TOKEN = "1.0"  # slow enough that concurrent requests are still prefilling when the next arrives
# Concurrent turns of one conversation with long questions: about 7 fit within the default balance_abs_threshold
# (4096 tokens of work beyond the cheapest prefill), the rest must go to the other prefill.
BURST = 14


@dataclass
class Stack:
    router: str
    prefills: list[str]


@pytest.fixture(scope="module")
def stack(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Stack]:
    logs = tmp_path_factory.mktemp("cache-aware")
    workers: list[SimWorker] = []
    router: ManagedProcess | None = None
    try:
        extra = ["--enable-metrics", "--sim-prefill-ms-per-token", PREFILL_MS_PER_TOKEN]
        workers += [start_prefill(f"prefill-{n}", logs, extra) for n in range(2)]
        workers.append(start_decode("decode", logs, ["--enable-metrics"]))
        port = free_port()
        argv = [sys.executable, "-m", "tandem.cli", "router", "--port", str(port), "--no-integrity",
                "--log-level", "warning", "--decode", workers[2].url]  # fmt: skip
        for p in workers[:2]:
            argv += ["--prefill", p.url, str(p.bootstrap_port)]
        router = ManagedProcess("router", argv, Path(logs) / "router.log").start()
        router.wait_http(f"http://{HOST}:{port}/readiness", timeout=60)
        yield Stack(f"http://{HOST}:{port}", [p.url for p in workers[:2]])
    finally:
        if router is not None:
            router.stop()
        for w in reversed(workers):
            w.proc.stop()


async def _served_by(
    http: aiohttp.ClientSession, stack: Stack, bodies: list[dict[str, object]]
) -> list[tuple[float, float]]:
    """Send ``bodies`` at once; the prompt tokens and cached tokens each prefill counted for them."""
    before = await prefill_counters(http, stack.prefills)
    await asyncio.gather(*(stream_ttft(http, f"{stack.router}/v1/chat/completions", b) for b in bodies))
    after = await prefill_counters(http, stack.prefills)
    return [(a[0] - b[0], a[1] - b[1]) for a, b in zip(after, before, strict=True)]


async def _conversations(stack: Stack, convs: list[Conversation]) -> tuple[list[set[int]], float, float]:
    """Turn by turn, one request at a time: which prefill served each conversation's turns; cached and prompt
    tokens of the turns after the first."""
    homes: list[set[int]] = [set() for _ in convs]
    cached = prompt = 0.0
    async with aiohttp.ClientSession() as http:
        for turn in range(len(convs[0].questions)):
            for n, conv in enumerate(convs):
                before = await prefill_counters(http, stack.prefills)
                body = chat_body(messages(conv, turn), SIM_MODEL)
                await stream_ttft(http, f"{stack.router}/v1/chat/completions", body)
                after = await prefill_counters(http, stack.prefills)
                served = [i for i, (a, b) in enumerate(zip(after, before, strict=True)) if a[0] > b[0]]
                assert len(served) == 1
                homes[n].add(served[0])
                if turn:
                    prompt += sum(a[0] - b[0] for a, b in zip(after, before, strict=True))
                    cached += sum(a[1] - b[1] for a, b in zip(after, before, strict=True))
    return homes, cached, prompt


def test_a_conversations_turns_stay_on_one_prefill(stack: Stack) -> None:
    convs = workload(users=4, turns=3, seed=7)
    homes, cached, prompt = asyncio.run(_conversations(stack, convs))
    assert all(len(h) == 1 for h in homes), homes
    assert cached / prompt > 0.8  # the history of every later turn was in its prefill's radix cache


def test_an_overloaded_prefill_sheds_part_of_a_burst_and_the_next_turn_still_hits(stack: Stack) -> None:
    conv = workload(users=2, turns=3, seed=11)[1]  # user 1: no pasted document, a history of about 1500 tokens

    async def scenario() -> tuple[list[tuple[float, float]], ...]:
        async with aiohttp.ClientSession() as http:
            first = await _served_by(http, stack, [chat_body(messages(conv, 1), SIM_MODEL)])
            # BURST next turns at once, each with a long question of its own: the conversation's prefill is
            # preferred (most of each prompt is its history), until the work queued there outweighs computing
            # the whole prompt on the other one.
            history = messages(conv, 2)
            question = "long question " * 300  # about 1050 tokens by the router's estimate
            bodies = [
                chat_body([*history[:-1], {"role": "user", "content": f"variant {i}: {question}"}], SIM_MODEL)
                for i in range(BURST)
            ]
            burst = await _served_by(http, stack, bodies)
            after = await _served_by(http, stack, [chat_body(messages(conv, 2), SIM_MODEL)])
            return first, burst, after

    first, burst, after = asyncio.run(scenario())
    home = next(i for i, (prompt, _) in enumerate(first) if prompt)
    other = 1 - home
    assert burst[home][0] > 0
    assert burst[other][0] > 0  # rebalanced: the overloaded prefill did not get them all
    prompt, cached = (sum(column) for column in zip(*after, strict=True))
    assert cached / prompt > 0.8  # the next plain turn went where its history is cached
