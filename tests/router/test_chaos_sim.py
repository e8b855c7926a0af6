"""Kill a prefill and a decode while 64 streams run through the router (real simulated workers, real Mooncake).

Requests that had not received a byte must all succeed (retried on a live pair with a new room); requests cut
after their first byte end with a clear error (never hang); the dead workers stop receiving traffic.
"""

from __future__ import annotations

import asyncio
import signal
import time
from dataclasses import dataclass
from pathlib import Path

import aiohttp
import openai
import pytest

from tandem.local_stack import MODEL, LocalStack, sim_worker_argv
from tandem.registry import Role
from tandem.stack_fixture import running_stack

pytestmark = pytest.mark.netns

FAST_PD_ENV = {
    "SGLANG_DISAGGREGATION_HEARTBEAT_INTERVAL": "1",
    "SGLANG_DISAGGREGATION_HEARTBEAT_MAX_FAILURE": "1",
    "SGLANG_DISAGGREGATION_WAITING_TIMEOUT": "10",
    "SGLANG_DISAGGREGATION_BOOTSTRAP_TIMEOUT": "10",
}
CONCURRENCY = 64
TOTAL = 192


def _slow_sim(role: Role, port: int, bootstrap_port: int | None) -> list[str]:
    return [*sim_worker_argv(role, port, bootstrap_port), "--sim-inter-token-ms", "15"]


STREAMING: set[int] = set()  # requests between their first chunk and their end


@dataclass
class Outcome:
    first_byte: bool = False
    ok: bool = False
    error: str = ""


async def _one(client: openai.AsyncOpenAI, i: int) -> Outcome:
    out = Outcome()
    try:
        stream = await client.chat.completions.create(
            model=MODEL, messages=[{"role": "user", "content": f"request {i}: tell me a long story"}],
            max_tokens=100, temperature=0, stream=True,
        )  # fmt: skip
        async for _chunk in stream:
            out.first_byte = True
            STREAMING.add(i)
        out.ok = True
    except openai.APIError as err:
        out.error = f"{type(err).__name__}: {err.message}"
    finally:
        STREAMING.discard(i)
    return out


async def _worker_urls_seen_by_router(url: str) -> set[str]:
    async with aiohttp.ClientSession() as http, http.get(f"{url}/metrics") as resp:
        text = await resp.text()
    return {line.split('worker="')[1].split('"')[0] for line in text.splitlines()
            if line.startswith("tandem_router_worker_in_flight{")}  # fmt: skip


async def _in_flight(url: str, worker: str) -> float:
    async with aiohttp.ClientSession() as http, http.get(f"{url}/metrics") as resp:
        text = await resp.text()
    prefix = "tandem_router_worker_in_flight{"
    return sum(float(line.rsplit(" ", 1)[1]) for line in text.splitlines()
               if line.startswith(prefix) and f'worker="{worker}"' in line)  # fmt: skip


def test_kill_a_prefill_and_a_decode_under_64_streams(tmp_path: Path) -> None:
    with running_stack(tmp_path, router_port=0, worker_argv=_slow_sim, restart=False, worker_env=FAST_PD_ENV,
                       router_args=["--retry-max-attempts", "6", "--policy", "round_robin"]) as stack:  # fmt: skip
        asyncio.run(_scenario(stack))


async def _scenario(stack: LocalStack) -> None:
    client = openai.AsyncOpenAI(base_url=f"{stack.router_url}/v1", api_key="none", max_retries=0, timeout=60)
    try:
        await _kill_under_load(stack, client)
    finally:
        await client.close()


async def _kill_under_load(stack: LocalStack, client: openai.AsyncOpenAI) -> None:
    prefill = next(w for w in stack.workers if w.role is Role.PREFILL)
    decode = next(w for w in stack.workers if w.role is Role.DECODE)
    assert {prefill.url, decode.url} <= await _worker_urls_seen_by_router(stack.router_url)
    sem = asyncio.Semaphore(CONCURRENCY)

    async def bounded(i: int) -> Outcome:
        async with sem:
            return await asyncio.wait_for(_one(client, i), 90)  # a hang fails the test here

    tasks = [asyncio.create_task(bounded(i)) for i in range(TOTAL)]
    # Kill while many streams are mid-flight, some of them on the victim decode, however loaded the machine.
    while len(STREAMING) < CONCURRENCY // 2 or await _in_flight(stack.router_url, decode.url) < 4:
        assert not all(t.done() for t in tasks), "all requests ended before the kill"
        await asyncio.sleep(0.05)
    killed_at = time.monotonic()
    prefill.proc.signal(signal.SIGKILL)
    decode.proc.signal(signal.SIGKILL)
    outcomes = await asyncio.gather(*tasks)

    cut = [o for o in outcomes if not o.ok]
    print(f"{len(cut)} cut after the first byte; errors: {sorted({o.error for o in cut})[:3]}")
    assert cut, "the kill hit no stream in flight"
    assert all(o.first_byte for o in cut), [o.error for o in cut if not o.first_byte]
    assert all(o.error for o in cut)
    assert sum(o.ok for o in outcomes) >= TOTAL - CONCURRENCY
    # The dead workers are out of the router's pool (deregistered; their breakers opened on the first refusal).
    while {prefill.url, decode.url} & await _worker_urls_seen_by_router(stack.router_url):
        assert time.monotonic() - killed_at < 15, "dead workers still in the router's pool"
        await asyncio.sleep(0.1)
    after = await asyncio.gather(*(bounded(TOTAL + i) for i in range(32)))
    assert all(o.ok for o in after), [o.error for o in after]
