"""The simulator under load, in-process: continuous batching (``engine/stepper.py``), the radix prefix cache
(``engine/radix.py``), profiles and the flag checks. No processes; times are simulated GPU times of a few ms."""

from __future__ import annotations

import asyncio
import re
import time

import pytest

from tandem_sim.config import ConfigError, parse
from tandem_sim.engine.engine import Engine, RunningRequest
from tandem_sim.engine.radix import RadixCache
from tandem_sim.engine.stepper import Stepper
from tandem_sim.main import main
from tandem_sim.metrics import Metrics
from tandem_sim.model import model
from tandem_sim.model.model import SamplingParams
from tandem_sim.model.profiles import KIMI_PUBLISHED, PROFILES, SimProfile

MODEL = ["--model-path", "sim/model"]


def _profile(base: float = 1.0, per_seq: float = 0.0, per_token: float = 0.0) -> SimProfile:
    return SimProfile("test", 0.0, per_token, base, per_seq, 0.0)


async def test_concurrent_sequences_share_decode_steps() -> None:
    stepper = Stepper(_profile(base=5.0), 16384, 8192)

    async def sequence(tokens: int) -> None:
        stepper.join()
        for step in range(tokens):
            await stepper.decode_step(100 + step)
            await asyncio.sleep(0)  # a streaming client write between tokens
        stepper.leave()

    await asyncio.gather(*(sequence(5) for _ in range(8)), sequence(20))
    assert stepper.stats.max_decode_batch == 9
    assert stepper.stats.decode_steps <= 22  # 8 x 5 + 20 tokens in about 20 shared steps, not 60
    await stepper.close()


async def test_step_time_grows_with_the_running_batch() -> None:
    async def run(seqs: int) -> float:
        stepper = Stepper(_profile(base=1.0, per_seq=1.0), 16384, 8192)
        started = time.monotonic()
        await asyncio.gather(*(stepper.decode_step(10) for _ in range(seqs)))
        await stepper.close()
        return time.monotonic() - started

    one, many = await run(1), await run(100)  # 2 ms vs 101 ms of simulated GPU time
    assert many > 5 * one
    assert many >= 0.1


async def test_long_prompt_is_chunked_and_short_prompts_share_a_batch() -> None:
    stepper = Stepper(_profile(per_token=0.01), 64, 32)
    await stepper.prefill(100)  # 32 + 32 + 32 + 4
    assert (stepper.stats.prefill_batches, stepper.stats.prefill_chunks) == (4, 3)
    await asyncio.gather(stepper.prefill(10), stepper.prefill(12))
    assert stepper.stats.prefill_batches == 5
    await stepper.close()


async def test_prefill_runs_before_waiting_decode_steps() -> None:
    """SGLang's ``get_next_batch_to_run``: a new prompt's prefill batch goes before the next decode step."""
    stepper = Stepper(_profile(base=1.0, per_token=1.0), 16384, 8192)
    order: list[str] = []

    async def decode() -> None:
        await stepper.decode_step(10)
        order.append("decode")

    async def prefill() -> None:
        await stepper.prefill(20)
        order.append("prefill")

    first = asyncio.ensure_future(decode())
    await asyncio.sleep(0)  # the first decode step is running
    await asyncio.gather(first, decode(), prefill())
    assert order == ["decode", "prefill", "decode"]
    await stepper.close()


def test_radix_matches_whole_pages_and_never_the_last_token() -> None:
    cache = RadixCache(page_size=4)
    ids, words = list(range(10)), [f"w{i}" for i in range(10)]
    assert cache.match_prefix(ids, words) == 0
    cache.insert(ids, words, capacity=1000)
    assert cache.cached_tokens == 8  # two whole pages; the partial third is not cached
    assert cache.match_prefix(ids, words) == 8
    assert cache.match_prefix(ids[:8], words[:8]) == 4  # at most len - 1 tokens, in whole pages
    assert cache.match_prefix(ids, ["x", *words[1:]]) == 0  # same ids, another surface word: another token


def test_radix_evicts_least_recently_used_leaves() -> None:
    cache = RadixCache(page_size=1)
    a, b = [1, 2, 3, 4], [5, 6, 7, 8]
    cache.insert(a, [str(i) for i in a], capacity=100)
    cache.insert(b, [str(i) for i in b], capacity=100)
    assert cache.match_prefix([*a, 0], [str(i) for i in a] + ["0"]) == 4  # a is now the most recent
    cache.insert([9, 10], ["9", "10"], capacity=6)
    assert cache.cached_tokens == 6
    assert cache.match_prefix([*a, 0], [str(i) for i in a] + ["0"]) == 4
    assert cache.match_prefix([*b, 0], [str(i) for i in b] + ["0"]) == 0  # b went first (least recently used)


def test_kimi_profile_reproduces_the_published_point() -> None:
    """279 sequences of ~2050 tokens: a 100 ms step and 2.79k tok/s per GPU (22.3k per 8-GPU node)."""
    kimi = PROFILES["kimi-k2.6-h200"]
    step = kimi.decode_s(279, 279 * 2050)
    assert step == pytest.approx(KIMI_PUBLISHED.itl_ms / 1000, rel=0.02)
    assert 279 / step == pytest.approx(KIMI_PUBLISHED.decode_tok_s, rel=0.02)
    assert 1 / kimi.prefill_s(1) == pytest.approx(KIMI_PUBLISHED.prefill_tok_s, rel=0.01)
    assert kimi.with_overrides(time_factor=4.0).decode_s(1, 0) == pytest.approx(4 * kimi.decode_s(1, 0))


def test_flags_set_profile_and_batching() -> None:
    cfg = parse([*MODEL, "--sim-profile", "kimi-k2.6-h200", "--sim-time-factor", "2", "--chunked-prefill-size", "-1"])
    assert cfg.profile.name == "kimi-k2.6-h200"
    assert cfg.profile.time_factor == 2.0
    assert (cfg.max_running_requests, cfg.max_prefill_tokens, cfg.chunked_prefill_size) == (256, 16384, -1)
    assert parse(MODEL).profile == PROFILES["cpu-small"]
    assert parse([*MODEL, "--sim-inter-token-ms", "1"]).profile.decode_base_ms == 1.0
    assert not parse([*MODEL, "--disable-radix-cache"]).radix_cache


@pytest.mark.parametrize(
    ("flags", "named"),
    [
        (["--chunked-prefill-size", "32768"], "--chunked-prefill-size 32768 is larger than --max-prefill-tokens"),
        (["--max-prefill-tokens", "1024", "--chunked-prefill-size", "2048"], "--max-prefill-tokens 1024"),
        (["--max-running-requests", "0"], "--max-running-requests must be positive"),
        (["--chunked-prefill-size", "0"], "--chunked-prefill-size must be positive or -1"),
        (["--max-prefill-tokens", "0"], "--max-prefill-tokens must be positive"),
        (["--sim-decode-ms-per-seq", "-1"], "--sim-decode-ms-per-seq must be >= 0"),
    ],
)
def test_impossible_combinations_exit_2_naming_the_flag(
    flags: list[str], named: str, capsys: pytest.CaptureFixture[str]
) -> None:
    with pytest.raises(ConfigError, match=re.escape(named)):
        parse([*MODEL, *flags])
    assert main([*MODEL, *flags]) == 2
    assert named in capsys.readouterr().err


async def test_a_request_waiting_for_a_running_slot_holds_no_pages() -> None:
    """Admission at ``--max-running-requests``: the waiting request takes pages only with its slot, so a decode
    whose running slots are all taken does not fill its pool with pages nobody holds."""
    cfg = parse([*MODEL, "--disaggregation-mode", "decode", "--max-running-requests", "1", "--page-size", "4"])
    engine = Engine(cfg, Metrics("sim/model"), cfg.kv_layout)
    params = SamplingParams(max_new_tokens=8)
    first, second = (RunningRequest(rid, model.tokenize("a short prompt"), params) for rid in ("a", "b"))
    await engine.admit(first)
    used = engine.pool.used_tokens
    waiting = asyncio.create_task(engine.admit(second))
    for _ in range(5):  # wake the waiter a few times: pages freed by others, its slot still taken
        async with engine._pages_changed:
            engine._pages_changed.notify_all()
        await asyncio.sleep(0)
    assert not waiting.done()
    assert engine.pool.used_tokens == used  # nothing taken while it waits
    await engine.release(first)
    await asyncio.wait_for(waiting, 5)
    await engine.release(second)
    assert engine.pool.used_tokens == 0
    assert engine.running == 0
