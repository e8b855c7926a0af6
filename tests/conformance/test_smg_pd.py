"""SGLang's own Rust router ``smg`` drives simulated workers in PD mode, as it would drive SGLang.

2 prefill + 2 decode simulators behind ``smg`` (pinned, installed by ``make peers``), round robin. Every endpoint
smg serves for PD (``/generate``, ``/v1/completions``, ``/v1/chat/completions``), streamed and not, must answer
exactly what an aggregated simulator answers at temperature 0, and the prefills' ``sglang:kv_transfer_total_mb``
must grow by exactly the prompt's KV bytes (prompt tokens x ``--sim-kv-bytes-per-token``, default 256).

What smg does that SGLang serves (``shared/reference/fidelity.md``): it sends ``model`` and ``background`` in
``/generate`` bodies (SGLang ignores unknown fields: tandem_sim.api.sglang_fields), tries HTTP/2 prior knowledge and
falls back to HTTP/1.1, and tries to download a tokenizer for the model name (offline: a warning).
"""

from __future__ import annotations

import json
import time
import urllib.request
from collections.abc import Iterator
from dataclasses import dataclass
from typing import Any

import aiohttp
import pytest

from tandem_dev import peers
from tandem_dev.procs import ManagedProcess, free_port
from tandem_dev.sim.testing import SimWorker, start_decode, start_prefill, start_worker
from tests.plumbing.simhelpers import metric_sum

pytestmark = [pytest.mark.netns, pytest.mark.procs, pytest.mark.timeout(180)]

MODEL = "kimi"
KV_BYTES_PER_TOKEN = 256  # the simulator's default --sim-kv-bytes-per-token
# Answers through smg are compared with the aggregated worker's: batch-invariant kernels, as a user wanting that runs.
SIM_ARGS = ["--served-model-name", MODEL, "--enable-metrics", "--enable-deterministic-inference"]
PROMPTS = ["kala bede fidu", "Once upon a time in a data center, far from any user", "Hello there"]


@dataclass
class Stack:
    smg: str
    prefills: list[SimWorker]
    reference: SimWorker


def _wait_for_workers(url: str, count: int, proc: ManagedProcess, timeout: float = 60.0) -> None:
    """smg registers workers in the background after /health answers: wait until it lists all of them."""
    deadline = time.monotonic() + timeout
    listed = "nothing"
    while time.monotonic() < deadline:
        if not proc.alive():
            raise AssertionError(f"smg exited:\n{proc.log_tail()}")
        try:
            with urllib.request.urlopen(f"{url}/workers", timeout=2) as resp:
                listed = resp.read().decode()
        except OSError as err:
            listed = str(err)
        if listed.count('"is_healthy":true') >= count:
            return
        time.sleep(0.2)
    raise AssertionError(f"smg did not list {count} healthy workers within {timeout}s: {listed[:500]}")


@pytest.fixture(scope="module")
def stack(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Stack]:
    logs = tmp_path_factory.mktemp("smg-pd")
    procs: list[ManagedProcess] = []
    try:
        prefills = [start_prefill(f"prefill{i}", logs, [*SIM_ARGS, "--log-level", "debug"]) for i in range(2)]
        procs += [w.proc for w in prefills]
        decodes = [start_decode(f"decode{i}", logs, SIM_ARGS) for i in range(2)]
        procs += [w.proc for w in decodes]
        reference = start_worker("aggregated", logs, SIM_ARGS)
        procs.append(reference.proc)
        port = free_port()
        argv = peers.smg_argv(
            [(w.url, w.bootstrap_port) for w in prefills], [w.url for w in decodes], port, free_port()
        )
        smg = ManagedProcess("smg", argv, logs / "smg.log").start()
        procs.append(smg)
        url = f"http://127.0.0.1:{port}"
        smg.wait_http(f"{url}/health", timeout=60)
        _wait_for_workers(url, 4, smg)
        yield Stack(url, prefills, reference)
    finally:
        for proc in reversed(procs):
            proc.stop()


def _body(path: str, prompt: str) -> dict[str, Any]:
    if path == "/generate":
        return {"text": prompt, "sampling_params": {"max_new_tokens": 12, "temperature": 0}}
    if path == "/v1/completions":
        return {"model": MODEL, "prompt": prompt, "max_tokens": 12, "temperature": 0}
    return {"model": MODEL, "messages": [{"role": "user", "content": prompt}], "max_tokens": 12, "temperature": 0}


def _text(path: str, doc: dict[str, Any]) -> str:
    if path == "/generate":
        return str(doc["text"])
    choice = doc["choices"][0]
    return str(choice["message"]["content"] if path == "/v1/chat/completions" else choice["text"])


def _prompt_tokens(path: str, doc: dict[str, Any]) -> int:
    return int(doc["meta_info"]["prompt_tokens"] if path == "/generate" else doc["usage"]["prompt_tokens"])


async def _answer(url: str, path: str, body: dict[str, Any], stream: bool) -> str:
    """The whole answer text; streamed: /generate sends the text so far, OpenAI endpoints send deltas."""
    async with aiohttp.ClientSession() as sess, sess.post(url + path, json={**body, "stream": stream}) as resp:
        raw = await resp.read()
        assert resp.status == 200, raw[:500]
    if not stream:
        return _text(path, json.loads(raw))
    events = [line[len(b"data: ") :] for line in raw.splitlines() if line.startswith(b"data: ")]
    assert events[-1] == b"[DONE]", raw[-200:]
    chunks = [json.loads(e) for e in events[:-1]]
    assert all("error" not in c for c in chunks), chunks
    if path == "/generate":
        return str(chunks[-1]["text"])
    key = "delta" if path == "/v1/chat/completions" else None
    return "".join(
        (c["choices"][0][key].get("content") or "") if key else c["choices"][0]["text"] for c in chunks if c["choices"]
    )


async def _moved_mb(stack: Stack) -> float:
    return sum([await metric_sum(p.url, "sglang:kv_transfer_total_mb_sum") for p in stack.prefills])


@pytest.mark.parametrize("stream", [False, True], ids=["whole", "streamed"])
@pytest.mark.parametrize("path", ["/generate", "/v1/completions", "/v1/chat/completions"])
async def test_smg_pd_answers_equal_aggregated_and_move_the_prompt_kv(stack: Stack, path: str, stream: bool) -> None:
    for prompt in PROMPTS:  # 3 requests, round robin over 2 prefills and 2 decodes
        body = _body(path, prompt)
        async with aiohttp.ClientSession() as sess, sess.post(stack.reference.url + path, json=body) as resp:
            reference = await resp.json()
        want = _text(path, reference)
        assert want, reference
        before = await _moved_mb(stack)
        got = await _answer(stack.smg, path, body, stream)
        assert got == want, (path, stream, prompt)
        moved = await _moved_mb(stack) - before
        assert moved == pytest.approx(_prompt_tokens(path, reference) * KV_BYTES_PER_TOKEN / 1e6, rel=1e-9)


async def test_smg_sends_fields_sglang_ignores(stack: Stack) -> None:
    """smg adds ``model`` to the /generate bodies it forwards; SGLang ignores it, and so does the simulator (debug)."""
    for prompt in PROMPTS[:2]:  # round robin: both prefills see one
        await _answer(stack.smg, "/generate", _body("/generate", prompt), stream=False)
    for prefill in stack.prefills:
        assert "ignoring unknown field(s) in /generate request: model" in prefill.proc.log_path.read_text()
