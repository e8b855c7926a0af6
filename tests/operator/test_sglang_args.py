"""The generated SGLang command lines against SGLang 0.5.23's own flag set.

``tandem.sglang_args`` (flag table read from the pinned sglang wheel) comes from the simulator branch; until it is
on this branch the test skips with that reason. The real ``sglang`` ServerArgs parser needs torch and is not
installed here.
"""

from __future__ import annotations

import importlib
from typing import Any

import pytest

from tandem.registry import Role
from tandem_operator.desired.args import LAUNCH, Placement, launch_command

from .conftest import kimi_spec


def _validator() -> Any:
    try:
        module = importlib.import_module("tandem.sglang_args")
    except ModuleNotFoundError:
        pytest.skip("tandem.sglang_args (flag table from the pinned SGLang 0.5.23 wheel) is not on this branch yet")
    return module.validate_command


SPECS = {
    "kimi-rdma-offload": kimi_spec(),
    "tcp-defaults": kimi_spec(transfer={"protocol": "tcp"}, decode={"groups": 1}),
    "extra-args": kimi_spec(
        prefill={"extraArgs": ["--enable-metrics-for-all-schedulers"], "memFractionStatic": 0.82},
        decode={"nodesPerGroup": 2, "tpSize": 16, "epSize": 16, "enableTwoBatchOverlap": True},
    ),
}


@pytest.mark.parametrize("name", SPECS)
@pytest.mark.parametrize("role", list(Role))
@pytest.mark.parametrize("rank", [0, 1])
def test_command_line_parses_with_sglang_flags(name: str, role: Role, rank: int) -> None:
    validate = _validator()
    command = launch_command(SPECS[name], Placement(role=role, node_rank=rank, leader_address="g.ns.svc"))
    assert tuple(command[: len(LAUNCH)]) == LAUNCH
    assert validate(command[len(LAUNCH) :]) == []
