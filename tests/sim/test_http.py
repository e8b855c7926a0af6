"""The SGLang HTTP surface of the simulated worker (aggregated mode), incl. the official openai SDK and bad input."""

from __future__ import annotations

import asyncio
import json
from collections.abc import Iterator
from pathlib import Path

import aiohttp
import openai
import pytest

from tandem_dev.procs import ManagedProcess
from tandem_dev.sim.testing import SimWorker, start_worker
from tests.plumbing.simhelpers import prompts

pytestmark = pytest.mark.procs


@pytest.fixture(scope="module")
def worker(tmp_path_factory: pytest.TempPathFactory) -> Iterator[SimWorker]:
    w = start_worker(
        "aggregated",
        tmp_path_factory.mktemp("sim-http"),
        [
            "--served-model-name",
            "kimi",
            "--enable-metrics",
            "--context-length",
            "256",
            "--page-size",
            "4",
            "--log-level",
            "debug",
            "--enable-deterministic-inference",  # texts of repeated and continued prompts are compared
        ],
    )
    yield w
    w.proc.stop()


async def _post(url: str, body: object | None = None, raw: bytes | None = None) -> tuple[int, object]:
    async with aiohttp.ClientSession() as sess:
        kwargs = {"data": raw} if raw is not None else {"json": body}
        async with sess.post(url, **kwargs) as resp:
            text = await resp.text()
            try:
                return resp.status, json.loads(text)
            except ValueError:
                return resp.status, text


async def _get(url: str) -> tuple[int, str]:
    async with aiohttp.ClientSession() as sess, sess.get(url) as resp:
        return resp.status, await resp.text()


async def test_generate_meta_info_and_determinism(worker: SimWorker) -> None:
    body = prompts(1)[0]
    status, first = await _post(f"{worker.url}/generate", body)
    assert status == 200
    assert isinstance(first, dict)
    meta = first["meta_info"]
    assert meta["prompt_tokens"] == len(body["text"].split())
    assert meta["completion_tokens"] == len(first["output_ids"])
    assert meta["finish_reason"]["type"] in {"length", "stop"}
    assert (await _post(f"{worker.url}/generate", body))[1]["text"] == first["text"]  # type: ignore[index]


async def test_generate_stream_is_sse_and_ends_with_done(worker: SimWorker) -> None:
    body = dict(prompts(1)[0], stream=True)
    async with aiohttp.ClientSession() as sess, sess.post(f"{worker.url}/generate", json=body) as resp:
        assert resp.headers["Content-Type"].startswith("text/event-stream")
        chunks = [line async for line in resp.content if line.strip()]
    assert chunks[-1] == b"data: [DONE]\n"
    assert len(chunks) >= 3


async def test_a_continued_text_is_whole_and_prompt_ids_come_back(worker: SimWorker) -> None:
    """Output after a prompt that ends in a word starts with its separator (SGLang decodes output ids after the
    prompt's last tokens), so prompt + output, or ids + more ids, continue one text; ``return_prompt_token_ids``
    puts the prompt's ids in every event."""
    sampling = {"max_new_tokens": 6, "temperature": 0, "ignore_eos": True}
    body = {"text": "kala mimi", "sampling_params": sampling}
    _, whole = await _post(f"{worker.url}/generate", {**body, "return_prompt_token_ids": True})
    assert isinstance(whole, dict)
    assert whole["text"].startswith(" ")
    ids = whole["prompt_token_ids"]
    assert len(ids) == 2
    half = {
        "input_ids": ids + whole["output_ids"][:3],
        "sampling_params": {**sampling, "max_new_tokens": 3},
    }
    _, rest = await _post(f"{worker.url}/generate", half)
    assert isinstance(rest, dict)
    assert whole["output_ids"] == whole["output_ids"][:3] + rest["output_ids"]
    assert whole["text"] == " " + " ".join(whole["text"].split()[:3]) + rest["text"]
    async with (
        aiohttp.ClientSession() as sess,
        sess.post(f"{worker.url}/generate", json={**body, "stream": True, "return_prompt_token_ids": True}) as resp,
    ):
        events = [json.loads(line[6:]) async for line in resp.content if line.startswith(b"data: {")]
    assert events
    assert all(e["prompt_token_ids"] == ids for e in events)
    chat = {"messages": [{"role": "user", "content": "kala"}], "max_tokens": 3}
    _, answer = await _post(f"{worker.url}/v1/chat/completions", chat)
    assert isinstance(answer, dict)
    assert not answer["choices"][0]["message"]["content"].startswith(" ")  # after the template's assistant marker


@pytest.mark.parametrize(
    ("raw", "fragment"),
    [
        (b"{not json", "Invalid JSON"),
        (b'{"text": "kala", "sampling_params": {"frobnicate": 1}}', "unknown field `frobnicate`, expected one of `max"),
        (b'{"text": "kala", "sampling_params": {"max_new_tokens": -1}}', "max_new_tokens"),
        (b'{"text": "kala", "sampling_params": {"max_new_tokens": 100000}}', "maximum context length"),
        (b'{"text": "' + b" kala" * 300 + b'"}', "longer than the model's context length"),
        (b'{"text": "kala", "sampling_params": {"top_p": 0}}', "top_p"),
        (b'{"sampling_params": {}}', "text or input_ids"),
        (b'{"input_ids": [1, -3]}', "input_ids"),
    ],
)
async def test_bad_generate_input_is_a_400(worker: SimWorker, raw: bytes, fragment: str) -> None:
    status, body = await _post(f"{worker.url}/generate", raw=raw)
    assert status == 400
    assert fragment in str(body)


@pytest.mark.parametrize(
    ("sampling", "error"),
    [
        # SGLang's contract gate (http_server.generate_request): 400 {"error": "<serde text>"}
        ({"temperature": "hot"}, 'invalid type: string "hot", expected f64'),
        ({"max_new_tokens": 1.5}, "invalid type: floating point `1.5`, expected i64"),
        # SamplingParams.verify after the gate (http_server._create_error_response): 400 {"error": {"message": ...}}
        ({"temperature": -1}, {"message": "temperature must be a non-negative finite number, got -1."}),
        ({"max_new_tokens": -1}, {"message": "max_new_tokens must be at least 0, got -1."}),
        ({"min_new_tokens": -2}, {"message": "min_new_tokens must be in [0, max_new_tokens(128)], got -2."}),
        ({"top_p": 0}, {"message": "top_p must be in (0, 1], got 0.0."}),
    ],
)
async def test_generate_errors_have_sglangs_shape_and_words(
    worker: SimWorker, sampling: dict[str, object], error: object
) -> None:
    status, body = await _post(f"{worker.url}/generate", {"text": "kala", "sampling_params": sampling})
    assert status == 400
    assert body == {"error": error}


def _answer(path: str, doc: object) -> object:
    assert isinstance(doc, dict)
    if path == "/generate":
        return doc["text"]
    choice = doc["choices"][0]
    return choice["message"]["content"] if path == "/v1/chat/completions" else choice["text"]


@pytest.mark.parametrize(
    ("path", "body"),
    [
        ("/generate", {"text": "kala bede", "sampling_params": {"max_new_tokens": 4, "temperature": 0}}),
        ("/v1/completions", {"model": "kimi", "prompt": "kala bede", "max_tokens": 4, "temperature": 0}),
        (
            "/v1/chat/completions",
            {"model": "kimi", "messages": [{"role": "user", "content": "kala"}], "max_tokens": 4, "temperature": 0},
        ),
    ],
)
async def test_unknown_fields_are_ignored_and_logged_at_debug(
    worker: SimWorker, path: str, body: dict[str, object]
) -> None:
    """SGLang ignores top-level fields it does not know (smg sends ``model`` and ``background`` to /generate)."""
    status, plain = await _post(worker.url + path, body)
    assert status == 200, plain
    status, extra = await _post(worker.url + path, {**body, "background": False, "frobnicate": {"x": 1}, "model": "m"})
    assert status == 200, extra
    assert _answer(path, extra) == _answer(path, plain)
    # GenerateReqInput has a `background` field; the OpenAI request models have `model`.
    ignored = "frobnicate, model" if path == "/generate" else "background, frobnicate"
    for _ in range(50):
        if f"ignoring unknown field(s) in {path} request: {ignored}" in worker.proc.log_path.read_text():
            return
        await asyncio.sleep(0.1)
    raise AssertionError(f"no debug line for the ignored fields of {path}")


async def test_openai_model_is_optional_as_in_sglang(worker: SimWorker) -> None:
    body = {"prompt": "kala bede", "max_tokens": 3, "temperature": 0}
    status, doc = await _post(f"{worker.url}/v1/completions", body)
    assert status == 200, doc
    status, doc = await _post(f"{worker.url}/v1/completions", {**body, "model": 7})
    assert status == 400
    assert "model: Input should be a valid string" in str(doc)


async def test_bootstrap_fields_validated_in_pd_modes_only(worker: SimWorker) -> None:
    # Aggregated mode ignores bootstrap fields, as SGLang does when not disaggregated.
    status, _ = await _post(f"{worker.url}/generate", dict(prompts(1)[0], bootstrap_room=5, bootstrap_host="h"))
    assert status == 200


def test_openai_sdk_chat_completion_and_stream_with_usage(worker: SimWorker) -> None:
    client = openai.OpenAI(base_url=f"{worker.url}/v1", api_key="none")
    try:
        models = client.models.list()
        assert [m.id for m in models.data] == ["kimi"]
        assert models.data[0].owned_by == "sglang"
        chat = client.chat.completions.create(
            model="kimi", messages=[{"role": "user", "content": "kala bede"}], max_tokens=6
        )
        assert chat.usage is not None
        assert chat.usage.completion_tokens <= 6
        content = chat.choices[0].message.content or ""
        stream = client.chat.completions.create(
            model="kimi",
            messages=[{"role": "user", "content": "kala bede"}],
            max_tokens=6,
            stream=True,
            stream_options={"include_usage": True},
        )
        parts, usage = [], None
        for chunk in stream:
            if chunk.choices:
                parts.append(chunk.choices[0].delta.content or "")
            if chunk.usage is not None:
                usage = chunk.usage
        assert "".join(parts) == content
        assert usage is not None
        assert usage.total_tokens == chat.usage.total_tokens
        completion = client.completions.create(model="kimi", prompt="kala bede bodo", max_tokens=4)
        assert completion.choices[0].finish_reason in {"length", "stop"}
        with pytest.raises(openai.BadRequestError, match="maximum context length"):
            client.completions.create(model="kimi", prompt="kala", max_tokens=10_000)
    finally:
        client.close()


async def test_info_health_metrics_endpoints(worker: SimWorker) -> None:
    for path in ("/health", "/health_generate", "/ready", "/model_info", "/get_model_info"):
        assert (await _get(f"{worker.url}{path}"))[0] == 200, path
    for path in ("/server_info", "/get_server_info"):
        status, text = await _get(f"{worker.url}{path}")
        assert status == 200
        assert '"internal_states"' in text
        assert '"served_model_name":"kimi"' in text
    status, text = await _get(f"{worker.url}/metrics")
    assert status == 200
    for name in ("sglang:num_running_reqs", "sglang:kv_used_tokens", "sglang:gen_throughput", "sglang:prompt_tokens"):
        assert name in text
    assert (await _post(f"{worker.url}/flush_cache"))[0] == 200
    assert (await _post(f"{worker.url}/abort_request", {"rid": "nope"}))[0] == 200


async def test_concurrent_requests_and_abort(worker: SimWorker) -> None:
    bodies = prompts(80, seed=9)
    results = await asyncio.gather(*(_post(f"{worker.url}/generate", b) for b in bodies))
    assert all(status == 200 for status, _ in results)
    long = {"text": "kala", "rid": "to-abort", "sampling_params": {"max_new_tokens": 200, "ignore_eos": True}}
    job = asyncio.ensure_future(_post(f"{worker.url}/generate", long))
    await asyncio.sleep(0.1)
    assert (await _post(f"{worker.url}/abort_request", {"rid": "to-abort"}))[0] == 200
    status, body = await job
    assert status == 500
    assert "aborted" in str(body)


def test_multinode_group_rank0_waits_for_ranks_and_dies_with_them(tmp_path: Path) -> None:
    from tandem_dev.procs import free_port

    addr = f"127.0.0.1:{free_port()}"
    group = ["--tp-size", "2", "--nnodes", "2", "--dist-init-addr", addr]
    rank0 = start_worker("rank0", tmp_path, [*group, "--node-rank", "0"], wait=False)
    procs: list[ManagedProcess] = [rank0.proc]
    try:
        rank0.proc.wait_http(f"{rank0.url}/health", expect=503)  # up, but the group is incomplete
        rank1 = start_worker("rank1", tmp_path, [*group, "--node-rank", "1"])  # dummy health server only
        procs.append(rank1.proc)
        rank0.proc.wait_http(f"{rank0.url}/health")
        rank1.proc.stop()
        assert rank0.proc.popen is not None
        assert rank0.proc.popen.wait(timeout=10) == 1  # like NCCL losing a rank: the group fails
    finally:
        for proc in procs:
            proc.stop()
