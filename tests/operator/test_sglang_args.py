"""The generated SGLang command lines against SGLang 0.5.23's flag table (``tandem.sglang_args``, read from the
pinned wheel). SGLang's real parser checks the same command lines in tests/conformance/test_sglang_parser.py."""

from __future__ import annotations

import pytest

from tandem.registry import Role
from tandem.sglang_args import validate_command
from tandem_operator.desired.args import LAUNCH, Placement, launch_command

from .conftest import kimi_spec

SPECS = {
    "kimi-rdma-offload": kimi_spec(),
    "tcp-defaults": kimi_spec(transfer={"protocol": "tcp"}, decode={"groups": 1}),
    "extra-args": kimi_spec(
        prefill={"extraArgs": ["--enable-metrics-for-all-schedulers"], "memFractionStatic": 0.82},
        decode={"nodesPerGroup": 2, "tpSize": 16, "epSize": 16, "enableTwoBatchOverlap": True},
    ),
    "deterministic": kimi_spec(deterministicInference=True),
}


@pytest.mark.parametrize("name", SPECS)
@pytest.mark.parametrize("role", list(Role))
@pytest.mark.parametrize("rank", [0, 1])
def test_command_line_parses_with_sglang_flags(name: str, role: Role, rank: int) -> None:
    command = launch_command(SPECS[name], Placement(role=role, node_rank=rank, leader_address="g.ns.svc"))
    assert tuple(command[: len(LAUNCH)]) == LAUNCH
    assert validate_command(command[len(LAUNCH) :]) == []


@pytest.mark.parametrize("role", list(Role))
def test_deterministic_inference_is_set_on_both_roles_only_when_asked(role: Role) -> None:
    """A prefill computes the first token and the KV, the decode the rest: both must run batch-invariant kernels."""
    placement = Placement(role=role, node_rank=0, leader_address="g.ns.svc")
    assert "--enable-deterministic-inference" in launch_command(SPECS["deterministic"], placement)
    assert "--enable-deterministic-inference" not in launch_command(SPECS["kimi-rdma-offload"], placement)
