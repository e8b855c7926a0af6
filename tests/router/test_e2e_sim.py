"""The `tandem up` stack (etcd, 2 prefill + 2 decode simulated workers moving KV over Mooncake, the router) driven
by the official ``openai`` SDK. Every output must equal the simulator's aggregated (non-PD) reference."""

from __future__ import annotations

import json
import sys
import urllib.request
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import openai
import pytest

from tandem_dev.local_stack import HOST, MODEL, LocalStack, deterministic_sim_worker_argv
from tandem_dev.procs import ManagedProcess, free_port
from tandem_dev.stack_fixture import running_stack

pytestmark = pytest.mark.netns

PROMPTS = ["Hello there", "Write a haiku about disaggregated serving", "Once upon a time in a data center"]


@pytest.fixture(scope="module")
def stack(tmp_path_factory: pytest.TempPathFactory) -> Iterator[LocalStack]:
    # Outputs are compared with the aggregated worker's: batch-invariant kernels, as a user wanting that runs SGLang.
    with running_stack(tmp_path_factory.mktemp("up"), router_port=0, worker_argv=deterministic_sim_worker_argv) as s:
        yield s


@pytest.fixture(scope="module")
def reference(tmp_path_factory: pytest.TempPathFactory) -> Iterator[openai.OpenAI]:
    """An aggregated simulated worker (prefill and decode in one process): the reference output."""
    port = free_port()
    argv = [sys.executable, "-m", "tandem.cli", "sim", "--model-path", MODEL, "--host", HOST, "--port", str(port)]
    argv.append("--enable-deterministic-inference")
    proc = ManagedProcess("aggregated", argv, tmp_path_factory.mktemp("ref") / "aggregated.log").start()
    try:
        proc.wait_http(f"http://{HOST}:{port}/health", timeout=60)
        yield openai.OpenAI(base_url=f"http://{HOST}:{port}/v1", api_key="none", max_retries=0)
    finally:
        proc.stop()


def _client(stack: LocalStack) -> openai.OpenAI:
    return openai.OpenAI(base_url=f"{stack.router_url}/v1", api_key="none", max_retries=0, timeout=60)


@pytest.mark.parametrize("prompt", PROMPTS)
def test_chat_equals_aggregated_reference(stack: LocalStack, reference: openai.OpenAI, prompt: str) -> None:
    kwargs: dict[str, Any] = {"model": MODEL, "messages": [{"role": "user", "content": prompt}], "max_tokens": 24,
                              "temperature": 0}  # fmt: skip
    want = reference.chat.completions.create(**kwargs)
    got = _client(stack).chat.completions.create(**kwargs)
    assert got.choices[0].message.content == want.choices[0].message.content
    assert got.choices[0].message.content
    assert got.usage == want.usage
    stream = _client(stack).chat.completions.create(**kwargs, stream=True, stream_options={"include_usage": True})
    chunks = list(stream)
    assert "".join(c.choices[0].delta.content or "" for c in chunks if c.choices) == want.choices[0].message.content
    assert chunks[-1].usage is not None
    assert chunks[-1].usage.completion_tokens == want.usage.completion_tokens


@pytest.mark.parametrize("prompt", PROMPTS)
def test_completions_equal_aggregated_reference(stack: LocalStack, reference: openai.OpenAI, prompt: str) -> None:
    kwargs: dict[str, Any] = {"model": MODEL, "prompt": prompt, "max_tokens": 16, "temperature": 0.7, "seed": 7}
    want = reference.completions.create(**kwargs).choices[0].text
    assert _client(stack).completions.create(**kwargs).choices[0].text == want
    streamed = "".join(c.choices[0].text for c in _client(stack).completions.create(**kwargs, stream=True) if c.choices)
    assert streamed == want


def test_tools_pass_through(stack: LocalStack, reference: openai.OpenAI) -> None:
    tools: Any = [{"type": "function", "function": {"name": "get_weather", "description": "weather in a city",
                   "parameters": {"type": "object", "properties": {"city": {"type": "string"}}}}}]  # fmt: skip
    kwargs: dict[str, Any] = {"model": MODEL, "messages": [{"role": "user", "content": "Weather in Paris?"}],
                              "tools": tools, "tool_choice": "auto", "max_tokens": 16, "temperature": 0}  # fmt: skip
    want = reference.chat.completions.create(**kwargs)
    got = _client(stack).chat.completions.create(**kwargs)
    assert got.choices[0].message == want.choices[0].message
    assert got.choices[0].finish_reason == want.choices[0].finish_reason


def test_models_and_errors(stack: LocalStack) -> None:
    client = _client(stack)
    assert [m.id for m in client.models.list().data] == [MODEL]
    with pytest.raises(openai.NotFoundError) as missing:
        client.chat.completions.create(model="no-such-model", messages=[{"role": "user", "content": "x"}])
    assert missing.value.code == "model_not_found"
    with pytest.raises(openai.BadRequestError):
        client.chat.completions.create(model=MODEL, messages=[])


def test_stack_logs_are_structured(stack: LocalStack) -> None:
    lines = [line for line in Path(stack.workdir / "router.log").read_text().splitlines() if line.strip()]
    assert lines
    assert all(line.startswith("{") for line in lines)


def test_n_choices_equal_aggregated_reference(stack: LocalStack, reference: openai.OpenAI) -> None:
    kwargs: dict[str, Any] = {"model": MODEL, "messages": [{"role": "user", "content": "Name three rivers"}],
                              "max_tokens": 12, "temperature": 0.8, "seed": 3, "n": 3}  # fmt: skip
    want = [c.message.content for c in reference.chat.completions.create(**kwargs).choices]
    got = [c.message.content for c in _client(stack).chat.completions.create(**kwargs).choices]
    assert len(got) == 3
    assert got == want


def _post_json(url: str, body: dict[str, Any]) -> Any:
    req = urllib.request.Request(url, json.dumps(body).encode(), {"Content-Type": "application/json"})
    with urllib.request.urlopen(req, timeout=60) as resp:
        return json.load(resp)


def test_generate_batch_equals_aggregated_reference(stack: LocalStack, reference: openai.OpenAI) -> None:
    body = {"text": PROMPTS, "sampling_params": {"max_new_tokens": 10, "temperature": 0}}
    want = _post_json(f"{str(reference.base_url).removesuffix('/v1/')}/generate", body)
    got = _post_json(f"{stack.router_url}/generate", body)
    assert [g["text"] for g in got] == [w["text"] for w in want]
    assert len(got) == len(PROMPTS)
