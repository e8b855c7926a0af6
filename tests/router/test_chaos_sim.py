"""Kill a prefill, or a decode, while 64 streams run through the router (real simulated workers, real Mooncake).

What each kill must show, read from the router's own metrics:

- it happens while the router counts requests in flight on the victim, streams past their first byte and
  requests still waiting for it (polled, never after a fixed sleep);
- every request that had not received a byte succeeds (retried on a live pair), and the retries are counted
  under the victim's role (``tandem_router_retries_total{reason="<role>_..."}``), none under the other role;
- a request cut after its first byte ends with a clear error (never hangs), and the router counted each one;
- the dead worker stays registered (the stack's supervisor leaves its key, as when nobody noticed the death
  yet), so only the router's breakers keep traffic off it: a later wave of requests all succeed and the dead
  worker sees only the breakers' few trial requests.
"""

from __future__ import annotations

import asyncio
import signal
from dataclasses import dataclass
from pathlib import Path

import openai
import pytest

from tandem.local_stack import MODEL, LocalStack, Worker, sim_worker_argv
from tandem.registry import Role
from tandem.stack_fixture import running_stack
from tests.routermetrics import RouterMetrics, scrape

pytestmark = pytest.mark.netns

FAST_PD_ENV = {
    "SGLANG_DISAGGREGATION_HEARTBEAT_INTERVAL": "1",
    "SGLANG_DISAGGREGATION_HEARTBEAT_MAX_FAILURE": "1",
    "SGLANG_DISAGGREGATION_WAITING_TIMEOUT": "10",
    "SGLANG_DISAGGREGATION_BOOTSTRAP_TIMEOUT": "10",
}
CONCURRENCY = 64
TOTAL = 192
MAX_TOKENS = 200  # 3 s per stream at 15 ms per token
STAGGER_S = 0.03  # between request starts: some are always in their prefill, some streaming
STREAMING_BEFORE_KILL = 8  # streams past their first byte (router-wide) when the victim is killed ...
WAITING_BEFORE_KILL = 4  # ... and requests still waiting for theirs (these must be retried)
WAVE = 64  # requests after the kill, CONCURRENCY / 8 at a time: round robin alone would send half to the dead one
# Trials the breakers may let through to the dead worker during the wave (half-open after each cooldown, which
# doubles on every failed trial or probe): far fewer than the WAVE / 2 a pool without breakers would send it.
MAX_TRIALS = WAVE // 8


def _slow_sim(role: Role, port: int, bootstrap_port: int | None) -> list[str]:
    # 3 s streams. Prefill batches run one at a time per worker (as on a GPU), so 64 prompts of ~15 tokens at
    # 4 ms/token keep a queue of up to ~4 s before their first byte, under FAST_PD_ENV's 10 s waiting timeout.
    slow = ["--sim-inter-token-ms", "15", "--sim-prefill-ms-per-token", "4"]
    return [*sim_worker_argv(role, port, bootstrap_port), *slow]


@dataclass
class Outcome:
    first_byte: bool = False
    ok: bool = False
    error: str = ""


def _time_to_kill(metrics: RouterMetrics, victim: str) -> bool:
    return (
        metrics.streaming >= STREAMING_BEFORE_KILL
        and metrics.before_first_byte >= WAITING_BEFORE_KILL
        and metrics.in_flight[victim] >= WAITING_BEFORE_KILL
    )


async def _one(client: openai.AsyncOpenAI, i: int) -> Outcome:
    out = Outcome()
    try:
        stream = await client.chat.completions.create(
            model=MODEL, messages=[{"role": "user", "content": f"request {i}: tell me a long story"}],
            max_tokens=MAX_TOKENS, temperature=0, stream=True,
        )  # fmt: skip
        async for _chunk in stream:
            out.first_byte = True
        out.ok = True
    except openai.APIError as err:
        out.error = f"{type(err).__name__}: {err.message}"
    return out


async def _run(client: openai.AsyncOpenAI, first: int, count: int, concurrency: int) -> list[asyncio.Task[Outcome]]:
    sem = asyncio.Semaphore(concurrency)

    async def bounded(i: int) -> Outcome:
        await asyncio.sleep((i - first) * STAGGER_S)
        async with sem:
            return await asyncio.wait_for(_one(client, i), 90)  # a hang fails the test here

    return [asyncio.create_task(bounded(i)) for i in range(first, first + count)]


@pytest.mark.parametrize("role", [Role.PREFILL, Role.DECODE], ids=["prefill", "decode"])
def test_a_worker_killed_under_64_streams(tmp_path: Path, role: Role) -> None:
    with running_stack(
        tmp_path, router_port=0, worker_argv=_slow_sim, restart=False, deregister_dead=False, worker_env=FAST_PD_ENV,
        router_args=["--retry-max-attempts", "6", "--policy", "round_robin"],
    ) as stack:  # fmt: skip
        victim = next(w for w in stack.workers if w.role is role)
        asyncio.run(_scenario(stack, victim))


async def _scenario(stack: LocalStack, victim: Worker) -> None:
    client = openai.AsyncOpenAI(base_url=f"{stack.router_url}/v1", api_key="none", max_retries=0, timeout=60)
    try:
        await _kill_under_load(stack, victim, client)
    finally:
        await client.close()


async def _kill_under_load(stack: LocalStack, victim: Worker, client: openai.AsyncOpenAI) -> None:
    other = Role.DECODE if victim.role is Role.PREFILL else Role.PREFILL
    before = await scrape(stack.router_url)
    assert {w.url for w in stack.workers} <= before.in_flight.keys()
    tasks = await _run(client, 0, TOTAL, CONCURRENCY)
    # Kill only once the router itself shows streams past their first byte, requests still waiting for it, and
    # requests on the victim, however loaded the machine.
    while not _time_to_kill(await scrape(stack.router_url), victim.url):
        assert not all(t.done() for t in tasks), "all requests ended before the router showed streams on the victim"
        await asyncio.sleep(0.05)
    victim.proc.signal(signal.SIGKILL)
    outcomes = await asyncio.gather(*tasks)
    after_kill = await scrape(stack.router_url)

    cut = [o for o in outcomes if not o.ok]
    retries = after_kill.retries - before.retries
    print(f"\n{victim.role.value} killed: {len(cut)} cut after the first byte, retries by reason {dict(retries)}")
    assert all(o.first_byte for o in cut), [o.error for o in cut if not o.first_byte]
    assert all(o.error for o in cut)
    if victim.role is Role.DECODE:
        assert cut, "the kill cut no stream on the victim decode"
    assert after_kill.stream_errors - before.stream_errors == len(cut)  # the router reported each cut stream
    assert sum(n for reason, n in retries.items() if reason.startswith(f"{victim.role.value}_")) >= 1, retries
    assert not [reason for reason in retries if reason.startswith(f"{other.value}_")], retries

    # Still registered (the supervisor left its key): only the router's breakers keep traffic off it.
    assert victim.url in after_kill.in_flight
    wave = await asyncio.gather(*await _run(client, TOTAL, WAVE, CONCURRENCY // 8))
    after_wave = await scrape(stack.router_url)
    assert all(o.ok for o in wave), [o.error for o in wave if not o.ok]
    trials = after_wave.failures[victim.url] - after_kill.failures[victim.url]
    print(f"the dead {victim.role.value} got {trials} of {WAVE} later requests (breaker trials)")
    assert trials <= MAX_TRIALS
    assert victim.url in after_wave.in_flight
