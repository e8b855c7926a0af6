"""The pod's Mooncake port range works with the real transfer engine (mooncake-transfer-engine 0.3.13, TCP).

Mooncake's TCP transport takes its data port from the same range as the RPC port (``MC_MIN_RPC_PORT`` ..
``MC_MAX_RPC_PORT``). One fixed port made ``initialize`` return -1 ("unable to find available tcp port"); the pod
now gets two adjacent ports for tcp. The engine is initialized with exactly the env the operator's manifest
gives the pod (downward-API values resolved as the kubelet would).
"""

from __future__ import annotations

import json
import os
import re
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest

from tandem.registry import Role
from tandem_operator.desired.pods import RoleContext, group_pod, mooncake_port_range
from tests.operator.conftest import kimi_spec
from tests.operator.workers import CLUSTER, POOL

pytestmark = pytest.mark.netns
SCRIPT = Path(__file__).with_name("mooncake_init.py")
TCP = kimi_spec(transfer={"protocol": "tcp"})


def pod_env(pod: dict[str, Any], ip: str) -> dict[str, str]:
    env: dict[str, str] = {}
    for var in pod["spec"]["containers"][0]["env"]:
        if "value" in var:
            env[var["name"]] = var["value"]
        elif var["valueFrom"]["fieldRef"]["fieldPath"] == "status.podIP":
            env[var["name"]] = ip
    return env


def initialize(ip: str, env: dict[str, str]) -> tuple[dict[str, Any], str]:
    proc = subprocess.run(
        [sys.executable, str(SCRIPT), ip, "tcp"],
        env={**os.environ, **env, "PYTHONPATH": os.pathsep.join(sys.path)},
        capture_output=True,
        text=True,
        timeout=60,
        check=True,
    )
    return json.loads(proc.stdout.strip().splitlines()[-1]), proc.stderr


def test_the_pods_tcp_range_initializes_and_uses_both_ports() -> None:
    ctx = RoleContext.build(CLUSTER, TCP, Role.DECODE, POOL)
    low, high = mooncake_port_range(ctx)
    assert (low, high) == (15100, 15101)
    env = pod_env(group_pod(ctx, 0, 0), "127.0.0.2")
    assert (env["MC_MIN_RPC_PORT"], env["MC_MAX_RPC_PORT"], env["MC_TCP_BIND_ADDRESS"]) == (
        "15100",
        "15101",
        "127.0.0.2",
    )
    result, log = initialize("127.0.0.2", env)
    assert result["rc"] == 0, log
    data = re.search(r"TcpTransport: listen on port (\d+)", log)
    assert data is not None, log
    # The RPC port (the session id "ip:port") is one port of the range, the TCP data port the other.
    assert {result["rpc_port"], int(data.group(1))} == {low, high}


def test_a_single_fixed_port_fails_over_tcp() -> None:
    """What the pods had before: kept as the reason for the range (if Mooncake changes, this says so)."""
    result, log = initialize("127.0.0.3", {"MC_MIN_RPC_PORT": "15010", "MC_MAX_RPC_PORT": "15010", "MC_FORCE_TCP": "1"})
    assert result["rc"] == -1
    assert "unable to find available tcp port" in log


def test_rdma_keeps_one_port() -> None:
    ctx = RoleContext.build(CLUSTER, kimi_spec(), Role.PREFILL, POOL)
    assert mooncake_port_range(ctx) == (15000, 15000)
