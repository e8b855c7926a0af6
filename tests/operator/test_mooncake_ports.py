"""The pod's Mooncake port range works with the real transfer engines (mooncake-transfer-engine 0.3.13, TCP).

SGLang runs one Mooncake engine per GPU rank, and Mooncake's TCP transport takes its data port from the same range
as the RPC port (``MC_MIN_RPC_PORT`` .. ``MC_MAX_RPC_PORT``): one fixed port made ``initialize`` return -1 ("unable
to find available tcp port"). The pod now gets two ports per rank for tcp (one per rank for rdma). The engines are
initialized with exactly the env the operator's manifest gives the pod (downward-API values resolved as the kubelet
would), one per rank, in one process as the pod's ranks share one environment, and in a network namespace of
their own as a pod's are: the suite's namespace is shared by every test, and an earlier test's Mooncake engine
(which listens on every interface) holding one port of the exact 16-port window made the 8th rank fail in one CI
run (stop 26), a failure no pod can have.
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
from tandem_operator.api.mooncake_ports import ports_needed
from tandem_operator.desired.pods import RoleContext, group_pod, mooncake_port_range
from tests.operator.conftest import kimi_spec
from tests.operator.workers import CLUSTER, POOL

pytestmark = pytest.mark.netns
SCRIPT = Path(__file__).with_name("mooncake_init.py")
IN_NETNS = Path(__file__).resolve().parents[2] / "scripts" / "in-netns.sh"  # a namespace of the engines' own
TCP = kimi_spec(transfer={"protocol": "tcp"})


def pod_env(pod: dict[str, Any], ip: str) -> dict[str, str]:
    env: dict[str, str] = {}
    for var in pod["spec"]["containers"][0]["env"]:
        if "value" in var:
            env[var["name"]] = var["value"]
        elif var["valueFrom"]["fieldRef"]["fieldPath"] == "status.podIP":
            env[var["name"]] = ip
    return env


def initialize(ip: str, env: dict[str, str], ranks: int = 1) -> tuple[dict[str, Any], str]:
    proc = subprocess.run(
        [str(IN_NETNS), sys.executable, str(SCRIPT), ip, "tcp", str(ranks)],
        env={**os.environ, **env, "PYTHONPATH": os.pathsep.join(sys.path)},
        capture_output=True,
        text=True,
        timeout=60,
        check=True,
    )
    return json.loads(proc.stdout.strip().splitlines()[-1]), proc.stderr


def test_the_pods_tcp_range_starts_every_rank() -> None:
    ctx = RoleContext.build(CLUSTER, TCP, Role.PREFILL, POOL)  # no Mooncake Store: the PD engines alone
    low, high = mooncake_port_range(ctx)
    assert (low, high) == (15000, 15015)  # 8 ranks x (RPC + TCP data port)
    env = pod_env(group_pod(ctx, 0, 0), "127.0.0.2")
    assert (env["MC_MIN_RPC_PORT"], env["MC_MAX_RPC_PORT"], env["MC_TCP_BIND_ADDRESS"]) == (
        "15000",
        "15015",
        "127.0.0.2",
    )
    store = RoleContext.build(CLUSTER, TCP, Role.DECODE, POOL)  # KV offload to the Store: its engine's ports too
    assert mooncake_port_range(store) == (15100, 15131)  # measured in tests/operator/test_mooncake_store_ports.py
    result, log = initialize("127.0.0.2", env, ranks=8)
    assert result["rcs"] == [0] * 8, log
    data = [int(p) for p in re.findall(r"TcpTransport: listen on port (\d+)", log)]
    # Every rank's session id "ip:port" and its TCP data port are distinct ports of the range.
    used = [*result["rpc_ports"], *data]
    assert sorted(used) == list(range(low, high + 1))


def test_one_port_short_fails_the_last_rank() -> None:
    """What an 8-rank pod got before (one port per rank is not enough over TCP)."""
    env = {"MC_MIN_RPC_PORT": "15200", "MC_MAX_RPC_PORT": "15214", "MC_FORCE_TCP": "1"}
    result, log = initialize("127.0.0.3", env, ranks=8)
    assert result["rcs"] == [0] * 7 + [-1]
    assert "unable to find available tcp port" in log


def test_a_single_fixed_port_fails_over_tcp() -> None:
    """What the pods had before: kept as the reason for the range (if Mooncake changes, this says so)."""
    result, log = initialize("127.0.0.3", {"MC_MIN_RPC_PORT": "15010", "MC_MAX_RPC_PORT": "15010", "MC_FORCE_TCP": "1"})
    assert result["rc"] == -1
    assert "unable to find available tcp port" in log


def test_rdma_gets_one_port_per_rank() -> None:
    ctx = RoleContext.build(CLUSTER, kimi_spec(), Role.PREFILL, POOL)
    assert mooncake_port_range(ctx) == (15000, 15007)
    assert ports_needed(8, "rdma") == 8
    assert ports_needed(8, "tcp") == 16
    one_gpu = kimi_spec(
        prefill={"tpSize": 1, "epSize": 1, "gpusPerNode": 1, "nodesPerGroup": 1, "moeA2ABackend": "none"}
    )
    assert mooncake_port_range(RoleContext.build(CLUSTER, one_gpu, Role.PREFILL, POOL)) == (15000, 15000)
