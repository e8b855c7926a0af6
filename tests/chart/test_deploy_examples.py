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


def test_production_example_follows_the_kimi_k26_cookbook() -> None:
    spec = PDClusterSpec.model_validate(yaml.safe_load((DEPLOY / "kimi-k26-h200.yaml").read_text())["spec"])
    assert spec.prefill.hicache.enabled  # HiCache + Mooncake Store on the prefill side (Mooncake's PD guide)
    assert spec.prefill.hicache.storage_backend == "mooncake"
    assert not spec.decode.kv_offload.enabled
    assert spec.prefill.moe_a2a_backend == spec.decode.moe_a2a_backend == "none"  # INT4 Marlin MoE: no DeepEP
    assert spec.prefill.tp_size == spec.decode.tp_size == 8  # the cookbook's H200 INT4 setting
    assert spec.model.tool_call_parser == spec.model.reasoning_parser == "kimi_k2"
    for role in (spec.prefill, spec.decode):
        assert {"cpu", "memory"} <= set(role.resources.requests)  # not BestEffort
