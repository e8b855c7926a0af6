"""Every PDCluster example in deploy/ is valid against the operator's models (the CRD's source of truth)."""

from __future__ import annotations

from pathlib import Path

import pytest
import yaml

from tandem_operator.api.pdcluster import PDClusterSpec

DEPLOY = Path(__file__).resolve().parents[2] / "deploy"
EXAMPLES = [p for p in sorted(DEPLOY.glob("*.yaml")) if not p.name.startswith("values-")]


def test_there_are_examples() -> None:
    assert {p.name for p in EXAMPLES} >= {"kimi-k26-h200.yaml", "sim-small.yaml"}


@pytest.mark.parametrize("path", EXAMPLES, ids=lambda p: p.name)
def test_example_is_a_valid_pdcluster(path: Path) -> None:
    doc = yaml.safe_load(path.read_text())
    assert (doc["apiVersion"], doc["kind"]) == ("tandem.dev/v1alpha1", "PDCluster")
    spec = PDClusterSpec.model_validate(doc["spec"])
    assert spec.prefill.tp_size == spec.prefill.nodes_per_group * spec.prefill.gpus_per_node


def test_production_example_offloads_decode_kv_to_mooncake_store() -> None:
    spec = PDClusterSpec.model_validate(yaml.safe_load((DEPLOY / "kimi-k26-h200.yaml").read_text())["spec"])
    assert spec.decode.kv_offload.enabled
    assert spec.decode.kv_offload.storage_backend == "mooncake"
    assert spec.model.tool_call_parser == spec.model.reasoning_parser == "kimi_k2"
