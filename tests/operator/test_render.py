"""``tandem render``: the operator's manifests for a PDCluster without a cluster, and API-server-style errors."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest
import yaml

from tandem_operator.run.render import InvalidClusterError, render, to_yaml

ROOT = Path(__file__).resolve().parents[2]
KIMI = ROOT / "deploy" / "kimi-k26-h200.yaml"


def test_the_kimi_recipe_renders_every_manifest() -> None:
    (doc,) = [d for d in yaml.safe_load_all(KIMI.read_text()) if d]
    manifests = render(doc)
    kinds = [(m["kind"], m["metadata"]["name"]) for m in manifests]
    prefill, decode = doc["spec"]["prefill"], doc["spec"]["decode"]
    pods = [name for kind, name in kinds if kind == "Pod"]
    assert len(pods) == prefill["groups"] * prefill["nodesPerGroup"] + decode["groups"] * decode["nodesPerGroup"]
    assert ("PDPool", "kimi-k26-prefill") in kinds
    assert ("Service", "kimi-k26-decode-1") in kinds
    assert {m["metadata"]["namespace"] for m in manifests} == {"serving"}
    for pod in (m for m in manifests if m["kind"] == "Pod"):
        command = pod["spec"]["containers"][0]["args"]
        assert command[:3] == ["python3", "-m", "sglang.launch_server"]
        assert "--disaggregation-mode" in command
        assert pod["metadata"]["annotations"]["tandem.dev/epoch"] == "0"
    assert {m["metadata"]["namespace"] for m in render(doc, "other")} == {"other"}


def test_invalid_input_gets_field_level_messages() -> None:
    doc = {
        "apiVersion": "tandem.dev/v1alpha1",
        "kind": "PDCluster",
        "metadata": {"name": "Bad_Name"},
        "spec": {
            "transfer": {"protocol": "udp"},
            "decode": {"epSize": 4, "moeA2ABackend": "deepep"},
            "prefill": {"tpSize": 2000},
            "etcd": {"endpoints": ["http://e:2379"]},
            "bogus": 1,
        },
    }
    with pytest.raises(InvalidClusterError) as err:
        render(doc)
    messages = err.value.messages
    assert 'Invalid value: "object": metadata.name must be a DNS label' in messages[0]
    assert 'spec.decode.epSize: Invalid value: "object": moeA2ABackend deepep needs epSize == tpSize' in messages
    assert 'spec.transfer.protocol: Unsupported value: "udp": supported values: "rdma", "tcp"' in messages
    assert (
        "spec.prefill.tpSize: Invalid value: 2000: spec.prefill.tpSize in body should be less than or equal to 1024"
        in messages
    )
    assert "spec.bogus: field not declared in schema" in messages
    assert str(err.value).startswith('The PDCluster "Bad_Name" is invalid: [')


def test_cli_prints_yaml_and_fails_with_messages(tmp_path: Path) -> None:
    ok = subprocess.run(
        [sys.executable, "-m", "tandem.cli", "render", "-f", str(KIMI), "-n", "llm"],
        capture_output=True,
        text=True,
        timeout=60,
        check=False,
    )
    assert ok.returncode == 0, ok.stderr
    assert {d["metadata"]["namespace"] for d in yaml.safe_load_all(ok.stdout)} == {"llm"}
    bad = tmp_path / "bad.yaml"
    bad.write_text(KIMI.read_text().replace("attnDpSize: 8", "attnDpSize: 3"))
    failed = subprocess.run(
        [sys.executable, "-m", "tandem.cli", "render", "-f", str(bad)],
        capture_output=True,
        text=True,
        timeout=60,
        check=False,
    )
    assert failed.returncode == 1
    assert 'spec.decode.attnDpSize: Invalid value: "object": attnDpSize must divide tpSize' in failed.stderr
    assert failed.stdout == ""


def test_output_keeps_number_like_strings_strings_for_kubectl() -> None:
    """A hex hash label such as "10363090e8" is a float to YAML 1.2 (kubectl) though PyYAML leaves it unquoted:
    ``tandem render`` quotes every string YAML 1.2 reads as a number, so its output applies as printed."""
    text = to_yaml([{"metadata": {"labels": {"tandem.dev/template-hash": "10363090e8", "x": "0x1f", "y": "abc"}}}])
    assert "'10363090e8'" in text
    assert "'0x1f'" in text
    assert "y: abc" in text
    assert yaml.safe_load(text)["metadata"]["labels"]["tandem.dev/template-hash"] == "10363090e8"
