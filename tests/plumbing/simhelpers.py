"""Helpers shared by the simulator tests: PD request fan-out and deterministic prompt sets."""

from __future__ import annotations

import asyncio
import random
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any

import aiohttp

from tandem_dev.procs import free_port
from tandem_dev.sim.testing import HOST, SimWorker, pd_fields, start_worker
from tandem_sim.model import model

# Rare words only: the simulated model never makes these up, so one in an output was copied from some context.
WORDS = model.vocabulary()[model.COMMON_WORDS_END :]


def real_words(n: int, seed: int = 0) -> list[str]:
    """``n`` distinct non-vocabulary words (the tokenizer hashes them to ids; their surface lives in the KV)."""
    rng = random.Random(seed)
    vocab = set(model.vocabulary())
    out: set[str] = set()
    while len(out) < n:
        word = "".join(rng.choice("aeioubcdfghjklmnprstvwxyz") for _ in range(rng.randint(3, 9)))
        if word not in vocab:
            out.add(word)
    return sorted(out)


REAL_WORDS = real_words(3000)


def prompts(n: int, seed: int = 1) -> list[dict[str, Any]]:
    """``n`` /generate bodies of mixed prompt and output lengths; prompts mix rare vocabulary words and real
    (non-vocabulary) words."""
    rng = random.Random(seed)
    bodies = []
    for _ in range(n):
        text = " ".join(rng.choice(REAL_WORDS if rng.random() < 0.7 else WORDS) for _ in range(rng.randint(6, 60)))
        params = {"max_new_tokens": rng.randint(8, 40), "temperature": rng.choice([0.0, 0.7, 1.0])}
        bodies.append({"text": text, "sampling_params": params})
    return bodies


async def pd_generate(
    sess: aiohttp.ClientSession, prefill: SimWorker, decode: SimWorker, body: dict[str, Any], room: int
) -> tuple[int, dict[str, Any], int]:
    """Send ``body`` to both workers at once, as a router does.

    Returns (decode status, decode body, prefill status or -1 if the prefill connection broke)."""
    full = dict(body, **pd_fields(prefill, room))

    async def post(url: str) -> tuple[int, Any]:
        async with sess.post(f"{url}/generate", json=full) as resp:
            return resp.status, await resp.json()

    async def post_prefill() -> int:
        try:
            return (await post(prefill.url))[0]
        except aiohttp.ClientError:
            return -1  # the prefill died mid-request (the failure tests kill it)

    p_status, (d_status, d_body) = await asyncio.gather(post_prefill(), post(decode.url))
    return d_status, d_body, p_status


async def bounded(concurrency: int, jobs: list[Any]) -> list[Any]:
    sem = asyncio.Semaphore(concurrency)

    async def run(job: Any) -> Any:
        async with sem:
            return await job

    return await asyncio.gather(*(run(j) for j in jobs))


async def metric_sum(url: str, name: str) -> float:
    """Sum of every sample of metric ``name`` (all label sets) on ``url``/metrics."""
    async with aiohttp.ClientSession() as sess, sess.get(f"{url}/metrics") as resp:
        text = await resp.text()
    return sum(float(line.rsplit(" ", 1)[1]) for line in text.splitlines() if line.split("{")[0].split(" ")[0] == name)


def start_group(
    name: str, log_dir: Path, nnodes: int, extra: Sequence[str], env: Mapping[str, str] | None = None
) -> list[SimWorker]:
    """A multi-node SGLang server: ``nnodes`` processes (node 0 first) sharing ``--dist-init-addr``; returns them
    once every node's ``/health`` answers 200 (node 0's serves the API, the others SGLang's dummy health)."""
    addr = f"{HOST}:{free_port()}"
    nodes: list[SimWorker] = []
    try:
        for rank in range(nnodes):
            group = ["--nnodes", str(nnodes), "--node-rank", str(rank), "--dist-init-addr", addr]
            nodes.append(start_worker(f"{name}-node{rank}", log_dir, [*extra, *group], env, wait=False))
        for node in nodes:
            node.proc.wait_http(f"{node.url}/health", timeout=120)
    except BaseException:
        for node in nodes:
            node.proc.stop()
        raise
    return nodes
