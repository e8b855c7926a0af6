"""The fleet workers (``tandem_dev.router.fleet_workers``) behind a real router with etcd discovery: a PD request
gets the answer the prompt determines, and a decode running the offload race leaks another prompt's words into
an answer only when a second request arrives while the first runs (never with one request at a time)."""

from __future__ import annotations

import asyncio
import random
import tempfile
from pathlib import Path
from typing import Any

import aiohttp
import orjson
import pytest

from tandem_dev.procs import ManagedProcess
from tandem_dev.router.bench_probing import Cluster, start_cluster
from tandem_dev.router.fleet_answers import clean_words

pytestmark = [pytest.mark.netns, pytest.mark.timeout(300)]


def _words(tag: str, n: int) -> str:
    return " ".join(f"{tag}{i}" for i in range(n))


async def _direct(sess: aiohttp.ClientSession, cluster: Cluster, decode: str, prompt: str) -> str:
    """One request through prefill 0 and ``decode``, with the bootstrap fields a router would add."""
    body: dict[str, Any] = {
        "text": prompt, "sampling_params": {"max_new_tokens": 40}, "bootstrap_host": "127.0.0.1",
        "bootstrap_port": int(cluster.fleet_url.rsplit(":", 1)[1]) + 4, "bootstrap_room": random.getrandbits(62),
    }  # fmt: skip
    _, answer = await asyncio.gather(
        sess.post(f"{cluster.prefills[0]}/generate", json=body), sess.post(f"{decode}/generate", json=body)
    )
    text: str = orjson.loads(await answer.read())["text"]
    return text


async def _check(cluster: Cluster) -> None:
    prompt = _words("alpha", 30)
    expected = "".join(f" {w}" for w in clean_words(prompt.split(), 20))
    body = {"text": prompt, "sampling_params": {"max_new_tokens": 20, "temperature": 0.0}}
    async with aiohttp.ClientSession() as sess:
        for _ in range(4):  # round robin or not, every pair answers alike
            async with sess.post(f"{cluster.routers[0]}/generate", json=body) as resp:
                assert resp.status == 200, await resp.text()
                assert (await resp.json())["text"] == expected
        async with sess.post(f"{cluster.routers[0]}/generate", json={**body, "stream": True}) as resp:
            events = [line for line in (await resp.read()).split(b"\n") if line.startswith(b"data: {")]
            assert orjson.loads(events[-1][6:])["text"] == expected

        bad = cluster.decodes[1]
        async with sess.post(f"{bad}/tandem/sim/faults", json={"offload_race": True}) as resp:
            assert resp.status == 200
        victim, thief = _words("victim", 40), _words("thief", 40)
        alone = await _direct(sess, cluster, bad, victim)
        assert alone.split() == clean_words(victim.split(), 40)  # one request at a time: no garbling

        async def late() -> str:
            await asyncio.sleep(0.4)  # after the victim's first offload (8 tokens of 20 ms fill its page)
            return await _direct(sess, cluster, bad, thief)

        garbled, clean = await asyncio.gather(_direct(sess, cluster, bad, victim), late())
        assert clean.split() == clean_words(thief.split(), 40)
        assert " ".join(f"thief{i}" for i in range(8)) in garbled
        assert garbled.split()[:8] == clean_words(victim.split(), 40)[:8]


def test_fleet_answers_deterministically_and_garbles_only_concurrently() -> None:
    procs: list[ManagedProcess] = []
    with tempfile.TemporaryDirectory(prefix="tandem-fleet-") as tmp:
        try:
            cluster = start_cluster(Path(tmp), procs, prefills=2, decodes=2, routers=1)
            asyncio.run(_check(cluster))
        finally:
            for proc in reversed(procs):
                proc.stop()
