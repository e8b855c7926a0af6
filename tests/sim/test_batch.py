"""Batch ``/generate`` (one bootstrap room per item), OpenAI ``n`` > 1 (one room per choice), tool-call and reasoning
fields, attention-DP routing (``room % dp_size``) and stream error chunks, in aggregated and PD mode.

Real processes on loopback: a prefill with ``--tp-size 2 --attn-dp-size 2`` (two ranks), a decode and an aggregated
reference worker.
"""

from __future__ import annotations

import asyncio
import json
import random
from collections.abc import AsyncIterator, Iterator
from typing import Any

import aiohttp
import pytest

from tandem_dev.sim.testing import HOST, SimWorker, start_decode, start_prefill, start_worker
from tests.plumbing.simhelpers import prompts

pytestmark = pytest.mark.procs

DP = 2


@pytest.fixture(scope="module")
def workers(tmp_path_factory: pytest.TempPathFactory) -> Iterator[tuple[SimWorker, SimWorker, SimWorker]]:
    log_dir = tmp_path_factory.mktemp("sim-batch")
    started: list[SimWorker] = []
    try:
        extra = ["--enable-metrics", "--tool-call-parser", "kimi_k2", "--reasoning-parser", "kimi_k2"]
        extra.append("--enable-deterministic-inference")  # PD answers are compared with the aggregated worker's
        started.append(start_prefill("prefill", log_dir, [*extra, "--tp-size", str(DP), "--attn-dp-size", str(DP)]))
        started.append(start_decode("decode", log_dir, extra))
        started.append(start_worker("aggregated", log_dir, extra))
        yield started[0], started[1], started[2]
    finally:
        for w in started:
            w.proc.stop()


@pytest.fixture
async def sess() -> AsyncIterator[aiohttp.ClientSession]:
    async with aiohttp.ClientSession(connector=aiohttp.TCPConnector(limit=0)) as session:
        yield session


async def _post(sess: aiohttp.ClientSession, url: str, body: Any) -> tuple[int, Any]:
    async with sess.post(url, json=body) as resp:
        return resp.status, await resp.json()


async def _pd(
    sess: aiohttp.ClientSession, prefill: SimWorker, decode: SimWorker, path: str, body: dict[str, Any], rooms: Any
) -> tuple[int, Any, int]:
    full = dict(body, bootstrap_host=HOST, bootstrap_port=prefill.bootstrap_port, bootstrap_room=rooms)
    p_job = _post(sess, f"{prefill.url}{path}", full)
    d_job = _post(sess, f"{decode.url}{path}", full)
    (p_status, _), (d_status, d_body) = await asyncio.gather(p_job, d_job)
    return d_status, d_body, p_status


def _rooms(n: int, seed: int) -> list[int]:
    rng = random.Random(seed)
    return [rng.randrange(2**63) for _ in range(n)]


async def test_batch_generate_pd_equals_aggregated(
    workers: tuple[SimWorker, SimWorker, SimWorker], sess: aiohttp.ClientSession
) -> None:
    prefill, decode, reference = workers
    items = prompts(6, seed=21)
    body = {"text": [b["text"] for b in items], "sampling_params": [b["sampling_params"] for b in items]}
    status, got, p_status = await _pd(sess, prefill, decode, "/generate", body, _rooms(6, 1))
    assert (status, p_status) == (200, 200), got
    singles = [(await _post(sess, f"{reference.url}/generate", b))[1] for b in items]
    assert isinstance(got, list)
    assert len(got) == 6
    assert [g["text"] for g in got] == [s["text"] for s in singles]
    assert [g["meta_info"]["prompt_tokens"] for g in got] == [len(b["text"].split()) for b in items]
    status, agg_batch = await _post(sess, f"{reference.url}/generate", body)
    assert status == 200
    assert [g["text"] for g in agg_batch] == [s["text"] for s in singles]
    # input_ids batches too, with one shared sampling_params object.
    ids_body = {"input_ids": [[100, 200, 300], [400, 500]], "sampling_params": {"max_new_tokens": 5}}
    status, got, _ = await _pd(sess, prefill, decode, "/generate", ids_body, _rooms(2, 2))
    assert status == 200
    assert [g["text"] for g in got] == [
        g["text"] for g in (await _post(sess, f"{reference.url}/generate", ids_body))[1]
    ]


async def test_batch_needs_one_room_per_item(
    workers: tuple[SimWorker, SimWorker, SimWorker], sess: aiohttp.ClientSession
) -> None:
    prefill, decode, _ = workers
    body = {"text": ["kala bede", "bodo"], "bootstrap_host": HOST, "bootstrap_port": prefill.bootstrap_port}
    for rooms in (5, [5], [5, 5]):
        status, err = await _post(sess, f"{decode.url}/generate", dict(body, bootstrap_room=rooms))
        assert status == 400
        assert "bootstrap_room" in err["error"]["message"]


async def test_openai_n_choices_pd_equals_aggregated(
    workers: tuple[SimWorker, SimWorker, SimWorker], sess: aiohttp.ClientSession
) -> None:
    prefill, decode, reference = workers
    body = {
        "model": "sim/model",
        "messages": [{"role": "user", "content": "tell me about Tokyo and Osaka trains"}],
        "max_tokens": 12,
        "temperature": 1.0,
        "n": 3,
    }
    status, got, p_status = await _pd(sess, prefill, decode, "/v1/chat/completions", body, _rooms(3, 3))
    assert (status, p_status) == (200, 200), got
    status, want = await _post(sess, f"{reference.url}/v1/chat/completions", body)
    assert status == 200
    texts = [c["message"]["content"] for c in got["choices"]]
    assert texts == [c["message"]["content"] for c in want["choices"]]
    assert [c["index"] for c in got["choices"]] == [0, 1, 2]
    assert len(set(texts)) == 3  # independent samples at temperature 1
    assert got["usage"]["completion_tokens"] == sum(len(t.split()) for t in texts)
    greedy = dict(body, temperature=0.0)
    status, got, _ = await _pd(sess, prefill, decode, "/v1/chat/completions", greedy, _rooms(3, 4))
    assert status == 200
    assert len({c["message"]["content"] for c in got["choices"]}) == 1  # greedy choices agree
    completion = {"model": "sim/model", "prompt": "kala bede bodo", "max_tokens": 5, "n": 2}
    status, got, _ = await _pd(sess, prefill, decode, "/v1/completions", completion, _rooms(2, 5))
    assert status == 200
    assert [c["index"] for c in got["choices"]] == [0, 1]


async def test_openai_stream_n_choices(workers: tuple[SimWorker, SimWorker, SimWorker]) -> None:
    _, _, reference = workers
    body = {"model": "sim/model", "prompt": "kala bede bodo", "max_tokens": 8, "n": 2, "stream": True}
    texts = {0: "", 1: ""}
    async with aiohttp.ClientSession() as sess, sess.post(f"{reference.url}/v1/completions", json=body) as resp:
        async for line in resp.content:
            if line.startswith(b"data: {"):
                chunk = json.loads(line[6:])
                for choice in chunk["choices"]:
                    texts[choice["index"]] += choice["text"]
    async with aiohttp.ClientSession() as sess:
        _, whole = await _post(sess, f"{reference.url}/v1/completions", dict(body, stream=False))
    assert [texts[0], texts[1]] == [c["text"] for c in whole["choices"]]


async def test_tools_and_reasoning_fields_pass_through(
    workers: tuple[SimWorker, SimWorker, SimWorker], sess: aiohttp.ClientSession
) -> None:
    _, _, reference = workers
    tools = [{"type": "function", "function": {"name": "get_weather", "parameters": {"type": "object"}}}]
    base = {"model": "sim/model", "messages": [{"role": "user", "content": "weather in Paris"}], "max_tokens": 6}
    status, auto = await _post(
        sess,
        f"{reference.url}/v1/chat/completions",
        dict(base, tools=tools, tool_choice="auto", separate_reasoning=True, chat_template_kwargs={"thinking": True}),
    )
    assert status == 200, auto
    assert "tool_calls" not in auto["choices"][0]["message"]  # SGLang's ChatMessage drops it when null
    assert auto["choices"][0]["message"]["reasoning_content"] is None
    named = {"type": "function", "function": {"name": "get_weather"}}
    status, forced = await _post(
        sess, f"{reference.url}/v1/chat/completions", dict(base, tools=tools, tool_choice=named)
    )
    assert status == 200
    choice = forced["choices"][0]
    assert choice["finish_reason"] == "tool_calls"
    call = choice["message"]["tool_calls"][0]
    assert call["function"]["name"] == "get_weather"
    assert json.loads(call["function"]["arguments"])["text"] == auto["choices"][0]["message"]["content"]
    bad = dict(base, tools=tools, tool_choice={"type": "function", "function": {"name": "nope"}})
    status, err = await _post(sess, f"{reference.url}/v1/chat/completions", bad)
    assert status == 400
    assert "nope" in err["message"]


async def test_attention_dp_routes_rooms_to_both_ranks(
    workers: tuple[SimWorker, SimWorker, SimWorker], sess: aiohttp.ClientSession
) -> None:
    prefill, decode, reference = workers
    async with sess.get(
        f"http://{HOST}:{prefill.bootstrap_port}/route",
        params={"prefill_dp_rank": "-1", "prefill_cp_rank": "-1", "target_tp_rank": "-1", "target_pp_rank": "-1"},
    ) as resp:
        assert (await resp.json())["dp_size"] == DP
    body = prompts(1, seed=4)[0]
    want = (await _post(sess, f"{reference.url}/generate", body))[1]["text"]
    for room in (10, 11, 2**63 - 1, 2**63 - 2):  # both parities: rank room % 2
        status, got, p_status = await _pd(sess, prefill, decode, "/generate", body, room)
        assert (status, p_status) == (200, 200)
        assert got["text"] == want
    async with sess.get(f"{decode.url}/server_info") as resp:
        state = (await resp.json())["internal_states"][0]
    assert state["prefill_peers"] == [f"{HOST}:{prefill.bootstrap_port}"]
    assert sorted(state["prefill_dp_ranks"]) == list(range(DP))


async def test_generate_stream_error_chunk(
    workers: tuple[SimWorker, SimWorker, SimWorker], sess: aiohttp.ClientSession
) -> None:
    """A PD failure after the stream started ends it with SGLang's error chunk, then [DONE]."""
    _, decode, _ = workers
    body = dict(
        prompts(1)[0], stream=True, bootstrap_host=HOST, bootstrap_port=1, bootstrap_room=7
    )  # no bootstrap server on port 1
    async with sess.post(f"{decode.url}/generate", json=body) as resp:
        assert resp.status == 200
        lines = [line.strip() async for line in resp.content if line.strip()]
    assert lines[-1] == b"data: [DONE]"
    error = json.loads(lines[-2][6:])["error"]
    assert error["code"] == 500
    assert "KVTransferError(bootstrap_room=7)" in error["message"]


async def test_completions_batch_prompts_echo_and_integer_logprobs(
    workers: tuple[SimWorker, SimWorker, SimWorker], sess: aiohttp.ClientSession
) -> None:
    """A list of prompts (strings or token lists) is a batch: prompt-major choices, ``n`` per prompt, each prompt
    counted once in usage; ``echo`` prefixes each choice with its prompt; ``logprobs`` may be an integer."""
    prefill, decode, reference = workers
    single = {"model": "sim/model", "max_tokens": 6, "temperature": 0}
    texts = {}
    for prompt in ("kala bede", "tokyo osaka trains"):
        status, got = await _post(sess, f"{reference.url}/v1/completions", dict(single, prompt=prompt))
        assert status == 200, got
        texts[prompt] = (got["choices"][0]["text"], got["usage"]["prompt_tokens"])
    batch = dict(single, prompt=list(texts), n=2, echo=True, logprobs=3, suffix="unused")
    status, got, p_status = await _pd(sess, prefill, decode, "/v1/completions", batch, _rooms(4, 9))
    assert (status, p_status) == (200, 200), got
    assert [c["index"] for c in got["choices"]] == [0, 1, 2, 3]
    want = [prompt + texts[prompt][0] for prompt in texts for _ in range(2)]  # SGLang's echo: prompt + text
    assert [c["text"] for c in got["choices"]] == want
    assert got["usage"]["prompt_tokens"] == sum(tokens for _, tokens in texts.values())
    ids = [[64, 65, 66], [70, 71]]
    status, got = await _post(sess, f"{reference.url}/v1/completions", dict(single, prompt=ids))
    assert status == 200, got
    assert len(got["choices"]) == 2
    empties: list[Any] = ["", [], [""], [[]]]
    for empty in empties:
        status, err = await _post(sess, f"{reference.url}/v1/completions", dict(single, prompt=empty))
        assert (status, err["message"]) == (400, "Prompt cannot be empty")
