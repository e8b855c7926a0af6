"""The simulator parses requests as SGLang 0.5.23 does, checked against SGLang's own code from the pinned wheel.

- The field sets of tandem_sim.api.sglang_fields equal SGLang's request models (read from the wheel with ast), and
  none of those models forbids extra fields (so unknown fields are ignored, as the simulator does).
- The simulator's ``/generate`` contract gate (tandem_sim.api.contract) gives SGLang's own decoder's verdict and
  message on a corpus of good and bad bodies (SGLang's decoder runs in the ``sglang-parser`` peer venv).
"""

from __future__ import annotations

import ast
import json
import os
import subprocess
import zipfile
from pathlib import Path
from typing import Any

import pytest

from tandem_dev import peers
from tandem_sim.api import contract, sglang_fields

pytestmark = [pytest.mark.procs, pytest.mark.timeout(300)]  # the peer venv imports torch (10-60 s on a loaded machine)
CONTRACT = Path(__file__).with_name("sglang_contract.py")
PROTOCOL = "sglang/srt/entrypoints/openai/protocol.py"

BODIES: list[Any] = [
    {"text": "hi", "model": "m", "background": False},  # smg's extra fields: ignored
    {"text": "hi", "sampling_params": {"max_new_tokens": 4, "temperature": 0, "stop": ["x"], "n": 1}},
    {"text": ["a", "b"], "sampling_params": [{"max_new_tokens": 1}, {"max_new_tokens": 2}]},
    {"input_ids": [1, 2, 3], "bootstrap_host": "h", "bootstrap_port": 8998, "bootstrap_room": 7},
    {"input_ids": [[1, 2], [3]], "bootstrap_room": [1, 2], "bootstrap_port": [None, 8998]},
    {"text": "hi", "sampling_params": {"frobnicate": 1}},
    {"text": "hi", "sampling_params": {"thinking_budget": 5}},
    {"text": "hi", "sampling_params": {"temperature": "hot"}},
    {"text": "hi", "sampling_params": {"max_new_tokens": 1.5}},
    {"text": "hi", "sampling_params": {"max_new_tokens": True}},
    {"text": "hi", "sampling_params": {"ignore_eos": 1}},
    {"text": "hi", "sampling_params": {"stop": 3}},
    {"text": "hi", "sampling_params": {"stop": ["a", 3]}},
    {"text": "hi", "sampling_params": {"stop_token_ids": "1"}},
    {"text": "hi", "sampling_params": {"logit_bias": {"1": "x"}}},
    {"text": "hi", "sampling_params": {"watermark": {"enabled": True, "salt": 1}}},
    {"text": "hi", "sampling_params": "greedy"},
    {"text": "hi", "sampling_params": [1]},
    {"text": 5},
    {"text": ["a", 5]},
    {"input_ids": "1 2 3"},
    {"input_ids": [1, "2"]},
    {"input_ids": [[1], ["x"]]},
    {"text": "hi", "stream": "yes"},
    {"text": "hi", "stream": 1},
    {"text": "hi", "rid": 5},
    {"text": "hi", "bootstrap_room": "7"},
    {"text": "hi", "bootstrap_room": 1.5},
    {"text": "hi", "bootstrap_port": [8998, "x"]},
    {"text": "hi", "bootstrap_host": 1},
    {"text": "hi", "return_logprob": "no"},
    {"text": "hi", "priority": 1.0},
    {"text": "hi", "stream": None, "sampling_params": None, "rid": None},
]


def _wheel() -> zipfile.ZipFile:
    return zipfile.ZipFile(peers.require("sglang-wheel"))


def _classes(source: str) -> dict[str, ast.ClassDef]:
    return {n.name: n for n in ast.parse(source).body if isinstance(n, ast.ClassDef)}


def _fields(classes: dict[str, ast.ClassDef], name: str) -> list[str]:
    node = classes[name]
    inherited = [f for base in node.bases if ast.unparse(base) in classes for f in _fields(classes, ast.unparse(base))]
    own = [s.target.id for s in node.body if isinstance(s, ast.AnnAssign) and isinstance(s.target, ast.Name)]
    return inherited + [f for f in own if not f.startswith("_")]


def _forbids_extra(node: ast.ClassDef) -> bool:
    return any("forbid" in ast.unparse(s) for s in node.body if isinstance(s, ast.Assign))


def test_generate_fields_are_sglangs() -> None:
    with _wheel() as wheel:
        classes = _classes(wheel.read("sglang/srt/managers/io_struct.py").decode())
        api_types = wheel.read("sglang/api/v1/api_types.py").decode()
    assert set(_fields(classes, "GenerateReqInput")) == sglang_fields.GENERATE_FIELDS
    assert '"""sglang.api.v1.GenerateRequest: JSON object (unknown keys ignored)."""' in api_types
    assert '"""sglang.api.v1.SamplingParams: JSON object (unknown keys rejected)."""' in api_types
    constants = {
        t.id: node.value
        for node in ast.parse(api_types).body
        if isinstance(node, ast.Assign)
        for t in node.targets
        if isinstance(t, ast.Name)
    }
    assert ast.literal_eval(constants["_FIELDS_SamplingParams"]) == sglang_fields.SAMPLING_FIELDS


@pytest.mark.parametrize(
    ("model", "known"),
    [("CompletionRequest", sglang_fields.COMPLETION_FIELDS), ("ChatCompletionRequest", sglang_fields.CHAT_FIELDS)],
)
def test_openai_fields_are_sglangs_and_extras_are_ignored(model: str, known: frozenset[str]) -> None:
    with _wheel() as wheel:
        classes = _classes(wheel.read(PROTOCOL).decode())
    assert set(_fields(classes, model)) == known
    assert not _forbids_extra(classes[model])
    assert not _forbids_extra(classes["PDRoutingFields"])
    assert any(_forbids_extra(node) for node in classes.values())  # the check can see a forbid (Decision*)


def _simulated(body: Any) -> str | None:
    try:
        contract.check_generate(body)
    except contract.ContractError as err:
        return str(err)
    return None


def test_generate_contract_verdicts_and_messages_equal_sglangs() -> None:
    done = subprocess.run(
        [str(peers.require("sglang-parser")), str(CONTRACT)],
        input=json.dumps(BODIES),
        capture_output=True,
        text=True,
        timeout=120,
        check=False,
        env={**os.environ, "PYTHONPATH": ""},
    )
    assert done.returncode == 0, done.stderr[-3000:]
    sglang = json.loads(done.stdout)
    assert sum(v is None for v in sglang) == 6  # the corpus has admitted bodies, and many refused ones
    mismatches = [(b, s, _simulated(b)) for b, s in zip(BODIES, sglang, strict=True) if s != _simulated(b)]
    assert mismatches == []
