"""Kill a prefill, or a decode, while 64 temperature-0 streams run through the router (real simulated workers,
real Mooncake): a third each of ``/v1/chat/completions``, ``/v1/completions`` and ``/generate`` (half of those
with a text prompt, half with ``input_ids``).

What each kill must show, read from the router's own metrics and from what the clients received:

- it happens while the router counts requests in flight on the victim, streams past their first byte and
  requests still waiting for it, and a dying decode itself holds requests waiting for their KV (polled, never
  after a fixed sleep);
- every request succeeds: those that had not received a byte are retried on a live pair (counted under the
  victim's role, ``tandem_router_retries_total{reason="<role>_..."}``, none under the other role), and a stream
  cut after its first byte is resumed on a fresh pair (``tandem_router_resumed_streams_total``, on every route
  when the decode dies, one resume gap observed per resume, no stream error counted);
- each client saw one uninterrupted stream: one ``id``, a finish reason, usage over the whole answer, and text,
  token count (and for ``/generate`` the output token ids) equal to the uninterrupted reference (the same request
  asked again afterwards, not streamed); the integrity detectors found nothing in the resumed streams;
- the dead worker stays registered (the stack's supervisor leaves its key, as when nobody noticed the death
  yet), so only the router's breakers keep traffic off it: a later wave of requests all succeed and the dead
  worker sees only the breakers' few trial requests.
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
from tandem_dev.local_stack import LocalStack, Worker, sim_worker_argv
from tandem_dev.stack_fixture import running_stack
from tandem_router.openai.schema import Route
from tandem_sim.model.model import COMMON_WORDS_END, VOCAB_SIZE, tokenize, vocabulary
from tests.plumbing.routermetrics import RouterMetrics, scrape
from tests.plumbing.simhelpers import metric_sum
from tests.router.streams import Outcome, reference, stream

pytestmark = [pytest.mark.netns, pytest.mark.timeout(300)]  # about 50 s alone; CI shares 2 cores

FAST_PD_ENV = {
    "SGLANG_DISAGGREGATION_HEARTBEAT_INTERVAL": "1",
    "SGLANG_DISAGGREGATION_HEARTBEAT_MAX_FAILURE": "1",
    "SGLANG_DISAGGREGATION_WAITING_TIMEOUT": "10",
    "SGLANG_DISAGGREGATION_BOOTSTRAP_TIMEOUT": "10",
}
CONCURRENCY = 64
TOTAL = 192
MAX_TOKENS = 200  # 3 s per stream at 15 ms per token
STAGGER_S = 0.03  # between request starts, on average: some are always in their prefill, some streaming ...
BURST = 8  # ... arriving BURST at a time, so that a queue waits for the prefills after each burst
STREAMING_BEFORE_KILL = 8  # streams past their first byte (router-wide) when the victim is killed ...
WAITING_BEFORE_KILL = 4  # ... and requests still waiting for theirs (these must be retried)
# A decode is killed later (right after a burst): streams of every route are cut on it, and some still wait on it.
BEFORE_DECODE_KILL = (24, 6)
# ... counted by the router as a whole: the victim decode must itself hold requests waiting for their KV (its
# sglang:num_decode_transfer_queue_reqs), which its death cuts before their first byte (a retry under "decode_").
DECODE_WAITING_FOR_KV = 2
WAITING_FOR_KV = "sglang:num_decode_transfer_queue_reqs"
MAX_ROUNDS = 4  # rounds of TOTAL requests started at most before the moment to kill comes
WAVE = 64  # requests after the kill, CONCURRENCY / 8 at a time: round robin alone would send half to the dead one
# Trials the breakers may let through to the dead worker during the wave (half-open after each cooldown, which
# doubles on every failed trial or probe): far fewer than the WAVE / 2 a pool without breakers would send it.
MAX_TRIALS = WAVE // 8


def default_numerics_sim(role: Role, port: int, bootstrap_port: int | None) -> list[str]:
    # 3 s streams. Prefill batches run one at a time per worker (as on a GPU), so 64 prompts of ~15 tokens at
    # 4 ms/token keep a queue of up to ~4 s before their first byte, under FAST_PD_ENV's 10 s waiting timeout.
    slow = ["--sim-inter-token-ms", "15", "--sim-prefill-ms-per-token", "4"]
    return [*sim_worker_argv(role, port, bootstrap_port), *slow]


def slow_sim(role: Role, port: int, bootstrap_port: int | None) -> list[str]:
    """Token-exact resume (every stream equal to the uninterrupted answer) is claimed with batch-invariant kernels
    only: the workers run as a user wanting it runs SGLang (default numerics: test_resume_numerics_sim.py)."""
    return [*default_numerics_sim(role, port, bootstrap_port), "--enable-deterministic-inference"]


def time_to_kill(
    metrics: RouterMetrics, victim: str, streaming: int = STREAMING_BEFORE_KILL, waiting: int = WAITING_BEFORE_KILL
) -> bool:
    return metrics.streaming >= streaming and metrics.before_first_byte >= waiting and metrics.in_flight[victim] >= 4


ROUTES = (Route.CHAT, Route.COMPLETIONS, Route.GENERATE)


def _request(i: int) -> tuple[Route, dict[str, Any]]:
    """Request ``i``: its route (``i`` mod 3) and body. ``/generate`` prompts are words of the simulated vocabulary:
    the simulator's token ids decode back only to vocabulary words (a real tokenizer's ids decode back to any
    text), and a resumed ``/generate`` stream is continued from token ids."""
    route = ROUTES[i % 3]
    if route is Route.CHAT:
        return route, {"messages": [{"role": "user", "content": f"request {i}: tell me a long story"}],
                       "max_tokens": MAX_TOKENS, "temperature": 0}  # fmt: skip
    if route is Route.COMPLETIONS:
        return route, {"prompt": f"request {i}: once upon a time", "max_tokens": MAX_TOKENS, "temperature": 0}
    # Rare words: the simulated model ends an answer only after a common word; these answers run as long as others.
    words = [vocabulary()[COMMON_WORDS_END + (i * 37 + k * 11) % (VOCAB_SIZE - COMMON_WORDS_END)] for k in range(12)]
    prompt: dict[str, Any] = {"text": " ".join(words)} if i % 2 else {"input_ids": tokenize(" ".join(words)).ids}
    return route, {**prompt, "sampling_params": {"max_new_tokens": MAX_TOKENS, "temperature": 0}}


async def _run(
    client: openai.AsyncOpenAI, http: aiohttp.ClientSession, first: int, count: int, concurrency: int
) -> list[asyncio.Task[Outcome]]:
    sem = asyncio.Semaphore(concurrency)

    async def bounded(i: int) -> Outcome:
        await asyncio.sleep((i - first) // BURST * BURST * STAGGER_S)
        async with sem:
            return await asyncio.wait_for(stream(*_request(i), client, http), 90)  # a hang fails the test here

    return [asyncio.create_task(bounded(i)) for i in range(first, first + count)]


@pytest.mark.parametrize("role", [Role.PREFILL, Role.DECODE], ids=["prefill", "decode"])
def test_a_worker_killed_under_64_streams(tmp_path: Path, role: Role) -> None:
    with running_stack(
        tmp_path, router_port=0, worker_argv=slow_sim, restart=False, deregister_dead=False, worker_env=FAST_PD_ENV,
        router_args=["--retry-max-attempts", "6", "--policy", "round_robin"],
    ) as stack:  # fmt: skip
        victim = next(w for w in stack.workers if w.role is role)
        asyncio.run(_scenario(stack, victim))


async def _scenario(stack: LocalStack, victim: Worker) -> None:
    client = openai.AsyncOpenAI(base_url=f"{stack.router_url}/v1", api_key="none", max_retries=0, timeout=60)
    timeout = aiohttp.ClientTimeout(total=60)
    try:
        async with aiohttp.ClientSession(timeout=timeout, connector=aiohttp.TCPConnector(limit=0)) as http:
            await _kill_under_load(stack, victim, client, http)
    finally:
        await client.close()


async def _kill_under_load(
    stack: LocalStack, victim: Worker, client: openai.AsyncOpenAI, http: aiohttp.ClientSession
) -> None:
    other = Role.DECODE if victim.role is Role.PREFILL else Role.PREFILL
    before = await scrape(stack.router_url)
    assert {w.url for w in stack.workers} <= before.in_flight.keys()
    first = 0
    tasks = await _run(client, http, first, TOTAL, CONCURRENCY)
    # Kill only once the router itself shows streams past their first byte, requests still waiting for it, and
    # requests on the victim, however loaded the machine: a round of TOTAL requests that ended before that moment
    # came (a busy machine thins the overlap) is checked to have succeeded and followed by another.
    streaming, waiting = (
        BEFORE_DECODE_KILL if victim.role is Role.DECODE else (STREAMING_BEFORE_KILL, WAITING_BEFORE_KILL)
    )
    while not time_to_kill(await scrape(stack.router_url), victim.url, streaming, waiting) or (
        victim.role is Role.DECODE and await metric_sum(victim.url, WAITING_FOR_KV) < DECODE_WAITING_FOR_KV
    ):
        if all(t.done() for t in tasks):
            assert first < (MAX_ROUNDS - 1) * TOTAL, f"{MAX_ROUNDS} rounds ended before the victim had streams"
            assert all(t.result().ok for t in tasks), [t.result().error for t in tasks if not t.result().ok]
            first += TOTAL
            tasks = await _run(client, http, first, TOTAL, CONCURRENCY)
        await asyncio.sleep(0.05)
    victim.proc.signal(signal.SIGKILL)
    outcomes = await asyncio.gather(*tasks)
    after_kill = await scrape(stack.router_url)

    failed = [o.error for o in outcomes if not o.ok]
    retries = after_kill.retries - before.retries
    resumed = after_kill.resumed - before.resumed
    routes = dict(after_kill.resumed_routes - before.resumed_routes)
    print(f"\n{victim.role.value} killed: retries {dict(retries)}, resumed {dict(resumed)}, by route {routes}")
    assert not failed, failed
    if victim.role is Role.DECODE:
        assert set(routes) == {r.value for r in ROUTES}, f"the kill cut no stream of some route: {routes}"
    assert after_kill.resume_gaps - before.resume_gaps == resumed.total()
    assert after_kill.stream_errors == before.stream_errors  # no stream ended with an error event
    assert after_kill.detections == before.detections  # a resumed stream is not garbled
    assert sum(n for reason, n in retries.items() if reason.startswith(f"{victim.role.value}_")) >= 1, retries
    assert not [reason for reason in retries if reason.startswith(f"{other.value}_")], retries
    sem = asyncio.Semaphore(CONCURRENCY)

    async def uninterrupted(i: int) -> tuple[dict[int, str], str | None, int, list[int] | None]:
        async with sem:
            return await reference(*_request(i), client, http)

    references = await asyncio.gather(*(uninterrupted(i) for i in range(first, first + TOTAL)))
    assert sum(len(texts[0]) > 100 for texts, *_ in references) > TOTAL // 2  # mostly long answers
    for i, (out, want) in enumerate(zip(outcomes, references, strict=True), start=first):
        assert len(out.ids) == 1, (i, out.ids)
        assert out.answer() == want, i

    # Still registered (the supervisor left its key): only the router's breakers keep traffic off it.
    assert victim.url in after_kill.in_flight
    before_wave = await scrape(stack.router_url)
    wave = await asyncio.gather(*await _run(client, http, first + TOTAL, WAVE, CONCURRENCY // 8))
    after_wave = await scrape(stack.router_url)
    assert all(o.ok for o in wave), [o.error for o in wave if not o.ok]
    trials = after_wave.failures[victim.url] - before_wave.failures[victim.url]
    print(f"the dead {victim.role.value} got {trials} of {WAVE} later requests (breaker trials)")
    assert trials <= MAX_TRIALS
    assert victim.url in after_wave.in_flight
