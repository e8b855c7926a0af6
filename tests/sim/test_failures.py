"""Failure behaviour as SGLang's: dead prefill (heartbeat), dead decode (blacklist), probe recovery, timeouts."""

from __future__ import annotations

import asyncio
import random
import signal
import time
from collections.abc import Awaitable, Callable
from pathlib import Path
from typing import Any

import aiohttp
import pytest

from tandem_dev.procs import ManagedProcess
from tandem_dev.sim.testing import SimWorker, start_decode, start_prefill, start_worker
from tests.plumbing.simhelpers import pd_generate, prompts

FAST_PD_ENV = {
    "SGLANG_DISAGGREGATION_HEARTBEAT_INTERVAL": "2",
    "SGLANG_DISAGGREGATION_HEARTBEAT_MAX_FAILURE": "1",
    "SGLANG_FAILED_SESSION_PROBE_INTERVAL_S": "0.5",
    "SGLANG_FAILED_SESSION_PROBE_MAX_INTERVAL_S": "1",
    "SGLANG_FAILED_SESSION_IDLE_TIMEOUT_S": "3",
}
LONG_PROMPT = {"text": " ".join(prompts(1, seed=5)[0]["text"].split() * 3), "sampling_params": {"max_new_tokens": 8}}


async def _wait_for(predicate: Callable[[], Awaitable[bool]], limit_s: float = 10.0) -> bool:
    """Poll ``predicate`` (bounded) until it holds; the state lives in another process, so polling it is."""
    deadline = time.monotonic() + limit_s
    while time.monotonic() < deadline:
        if await predicate():
            return True
        await asyncio.sleep(0.2)
    return await predicate()


async def _state(worker: SimWorker) -> dict[str, Any]:
    async with aiohttp.ClientSession() as sess, sess.get(f"{worker.url}/server_info") as resp:
        info = await resp.json()
    state: dict[str, Any] = info["internal_states"][0]
    return state


@pytest.mark.netns
@pytest.mark.timeout(90)
async def test_killed_prefill_fails_in_flight_within_heartbeat_then_restart_serves(
    tmp_path: Path, proc_factory: list[ManagedProcess]
) -> None:
    slow = ["--sim-prefill-ms-per-token", "40"]  # ~7 s of prefill: the kill lands mid-transfer
    prefill = start_prefill("prefill", tmp_path, slow, env=FAST_PD_ENV)
    proc_factory.append(prefill.proc)
    decode = start_decode("decode", tmp_path, env=FAST_PD_ENV)
    proc_factory.append(decode.proc)
    rng = random.Random(11)
    async with aiohttp.ClientSession() as sess:
        jobs = [
            asyncio.ensure_future(pd_generate(sess, prefill, decode, LONG_PROMPT, rng.randrange(2**63)))
            for _ in range(3)
        ]
        await asyncio.sleep(1.0)
        killed_at = time.monotonic()
        prefill.proc.signal(signal.SIGKILL)
        for job in jobs:
            status, body, _ = await job
            assert status == 500
            assert "Lost connection with prefill instance (bootstrap_addr: 127.0.0.1:" in body["error"]["message"]
            assert "Decode transfer failed for request" in body["error"]["message"]
        # interval 2 s x 1 miss (+ the health probe's own timeouts): well within the heartbeat window
        assert time.monotonic() - killed_at < 2 * 2 + 3
        restarted = start_prefill(
            "prefill-restarted",
            tmp_path,
            ["--disaggregation-bootstrap-port", str(prefill.bootstrap_port)],
            env=FAST_PD_ENV,
            port=prefill.port,
        )
        proc_factory.append(restarted.proc)
        restarted.bootstrap_port = prefill.bootstrap_port
        status, body, p_status = await pd_generate(sess, restarted, decode, prompts(1)[0], rng.randrange(2**63))
        assert (status, p_status) == (200, 200), body


@pytest.mark.netns
@pytest.mark.timeout(90)
async def test_failed_send_blacklists_and_probe_recovers(tmp_path: Path, proc_factory: list[ManagedProcess]) -> None:
    # the PD answer is compared with the aggregated worker's: batch-invariant kernels, as a user wanting that runs
    deterministic = ["--enable-deterministic-inference"]
    prefill = start_prefill("prefill", tmp_path, ["--enable-metrics", *deterministic], env=FAST_PD_ENV)
    proc_factory.append(prefill.proc)
    decode = start_decode("decode", tmp_path, deterministic, env=FAST_PD_ENV)
    proc_factory.append(decode.proc)
    reference = start_worker("aggregated", tmp_path, deterministic)
    proc_factory.append(reference.proc)
    rng = random.Random(12)
    body = prompts(1, seed=3)[0]
    async with aiohttp.ClientSession() as sess:
        # A transient failure (SGLANG_TEST_DISAGG_FAILURE_PROB switched on at runtime) blacklists a live session.
        async with sess.post(f"{prefill.url}/tandem/sim/faults", json={"transfer_failure_prob": 1.0}) as resp:
            assert resp.status == 200
        status, got, p_status = await pd_generate(sess, prefill, decode, body, rng.randrange(2**63))
        assert (status, p_status) == (500, 500)
        assert "Failed to send kv chunk" in got["error"]["message"]
        session = (await _state(decode))["session_id"]
        assert (await _state(prefill))["failed_sessions"] == [session]
        async with sess.post(f"{prefill.url}/tandem/sim/faults", json={"transfer_failure_prob": 0.0}) as resp:
            assert resp.status == 200

        # The probe (send_probe every 0.5 s) finds the decode alive and un-blacklists it.
        async def recovered() -> bool:
            return not (await _state(prefill))["failed_sessions"]

        assert await _wait_for(recovered)
        async with sess.get(f"{prefill.url}/metrics") as resp:
            assert 'sglang:failed_session_recoveries_total{model_name="sim/model"} 1.0' in await resp.text()
        status, got, _ = await pd_generate(sess, prefill, decode, body, rng.randrange(2**63))
        async with sess.post(f"{reference.url}/generate", json=body) as resp:
            want = await resp.json()
        assert status == 200
        assert got["text"] == want["text"]


@pytest.mark.netns
@pytest.mark.timeout(90)
async def test_killed_decode_is_blacklisted_then_dropped_and_new_decode_serves(
    tmp_path: Path, proc_factory: list[ManagedProcess]
) -> None:
    prefill = start_prefill("prefill", tmp_path, ["--sim-prefill-ms-per-token", "30"], env=FAST_PD_ENV)
    proc_factory.append(prefill.proc)
    decode = start_decode("decode", tmp_path, env=FAST_PD_ENV)
    proc_factory.append(decode.proc)
    rng = random.Random(13)
    async with aiohttp.ClientSession() as sess:
        dead_session = (await _state(decode))["session_id"]
        job = asyncio.ensure_future(pd_generate(sess, prefill, decode, LONG_PROMPT, rng.randrange(2**63)))
        await asyncio.sleep(1.0)  # decode handed over its pages; prefill is still computing
        decode.proc.signal(signal.SIGKILL)
        with pytest.raises(aiohttp.ClientError):
            await job  # the client's decode connection dies with the decode

        async def blacklisted() -> bool:
            return dead_session in (await _state(prefill))["failed_sessions"]

        assert await _wait_for(blacklisted)
        # A restarted decode is a new Mooncake session: served at once.
        fresh = start_decode("decode-restarted", tmp_path, env=FAST_PD_ENV)
        proc_factory.append(fresh.proc)
        status, body, p_status = await pd_generate(sess, prefill, fresh, prompts(1)[0], rng.randrange(2**63))
        assert (status, p_status) == (200, 200), body

        # The dead session never answers the probe; it is dropped after the idle timeout (3 s here).
        async def dropped() -> bool:
            return not await blacklisted()

        assert await _wait_for(dropped)


@pytest.mark.netns
@pytest.mark.timeout(60)
async def test_bootstrap_and_waiting_timeouts(tmp_path: Path, proc_factory: list[ManagedProcess]) -> None:
    env = {"SGLANG_DISAGGREGATION_BOOTSTRAP_TIMEOUT": "1", "SGLANG_DISAGGREGATION_WAITING_TIMEOUT": "1"}
    prefill = start_prefill("prefill", tmp_path, env=env)
    proc_factory.append(prefill.proc)
    decode = start_decode("decode", tmp_path, env=env)
    proc_factory.append(decode.proc)
    body = dict(prompts(1)[0], bootstrap_host="127.0.0.1", bootstrap_port=prefill.bootstrap_port, bootstrap_room=42)
    async with aiohttp.ClientSession() as sess:
        async with sess.post(f"{prefill.url}/generate", json=body) as resp:  # no decode ever asks for room 42
            assert resp.status == 500
            assert "timed out after" in (await resp.json())["error"]["message"]
            assert "KVPoll.Bootstrapping" in (await resp.json())["error"]["message"]
        async with sess.post(f"{decode.url}/generate", json=dict(body, bootstrap_room=43)) as resp:  # no prefill
            assert resp.status == 500
            assert "KVPoll.WaitingForInput" in (await resp.json())["error"]["message"]


@pytest.mark.netns
@pytest.mark.timeout(90)
async def test_transfer_failure_limited_to_one_decode_session(
    tmp_path: Path, proc_factory: list[ManagedProcess]
) -> None:
    """``to_sessions``: a link broken between the prefill and one decode; sends to the other decode still work."""
    prefill = start_prefill("prefill", tmp_path, env=FAST_PD_ENV)
    proc_factory.append(prefill.proc)
    broken = start_decode("decode-broken", tmp_path, env=FAST_PD_ENV)
    proc_factory.append(broken.proc)
    healthy = start_decode("decode-healthy", tmp_path, env=FAST_PD_ENV)
    proc_factory.append(healthy.proc)
    rng = random.Random(14)
    body = prompts(1, seed=4)[0]
    async with aiohttp.ClientSession() as sess:
        session = (await _state(broken))["session_id"]
        fault = {"transfer_failure_prob": 1.0, "to_sessions": [session]}
        async with sess.post(f"{prefill.url}/tandem/sim/faults", json=fault) as resp:
            assert resp.status == 200
        async with sess.post(f"{prefill.url}/tandem/sim/faults", json={**fault, "to_sessions": 3}) as resp:
            assert resp.status == 400
        status, _, p_status = await pd_generate(sess, prefill, healthy, body, rng.randrange(2**63))
        assert (status, p_status) == (200, 200)
        status, got, p_status = await pd_generate(sess, prefill, broken, body, rng.randrange(2**63))
        assert (status, p_status) == (500, 500)
        assert "Failed to send kv chunk" in got["error"]["message"]
        assert (await _state(prefill))["failed_sessions"] == [session]
