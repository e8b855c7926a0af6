"""A rank with a Mooncake Store over tcp needs twice the ports of its PD engine alone: measured with the real
mooncake-transfer-engine wheel (the CPU build of the release the worker image pins) and a real ``mooncake_master``.

SGLang 0.5.23 starts the rank's PD transfer engine first (P2PHANDSHAKE, ``init_mooncake_transfer_engine``); over tcp
the Store cannot reuse it (``MooncakeStore.__init__`` reuses it only over rdma), so ``MooncakeDistributedStore.setup``
starts a second engine that takes its RPC and TCP data ports from the same ``MC_MIN_RPC_PORT..MC_MAX_RPC_PORT``
window. The operator sizes each rank's window with ``ports_per_rank(protocol, store)``: with one port fewer the Store
fails as SGLang would see it at start-up, after the weights loaded.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path

import pytest

from tandem_dev.procs import ManagedProcess, free_port
from tandem_operator.api.mooncake_ports import ports_per_rank

pytestmark = [pytest.mark.procs, pytest.mark.netns, pytest.mark.timeout(120)]

FIRST_PORT = 21000  # below the ephemeral range (Mooncake ignores a window inside it)

RANK = """
import json, os, sys
from mooncake.engine import TransferEngine
from mooncake.store import MooncakeDistributedStore
engine = TransferEngine()  # the rank's PD engine, as SGLang starts it first
pd = engine.initialize("127.0.0.1", "P2PHANDSHAKE", "tcp", "")
store = MooncakeDistributedStore()
rc = store.setup("127.0.0.1", "P2PHANDSHAKE", 64 << 20, 16 << 20, "tcp", "", sys.argv[1])
value = b"kv page" * 64
put = store.put("page-0", value) if rc == 0 else None
got = store.get("page-0") if rc == 0 else b""
print(json.dumps({"pd": pd, "store": rc, "put": put, "read_back": got == value}))
"""


@pytest.fixture(scope="module")
def master(tmp_path_factory: pytest.TempPathFactory) -> Iterator[str]:
    """A real ``mooncake_master`` (from the wheel) on loopback: its RPC address."""
    workdir = tmp_path_factory.mktemp("master")
    port = free_port()
    binary = str(Path(sys.executable).parent / "mooncake_master")
    argv = [binary, f"--rpc_port={port}", f"--metrics_port={free_port()}", "--cluster_id=tandem"]
    proc = ManagedProcess("mooncake-master", argv, workdir / "master.log").start()
    try:
        yield f"127.0.0.1:{port}"
    finally:
        proc.stop()


def _rank(master: str, window: int) -> dict[str, object]:
    env = {
        **os.environ,
        "MC_FORCE_TCP": "1",
        "MC_MIN_RPC_PORT": str(FIRST_PORT),
        "MC_MAX_RPC_PORT": str(FIRST_PORT + window - 1),
        "MC_STORE_CLIENT_SETUP_RETRIES": "1",
    }
    done = subprocess.run(
        [sys.executable, "-c", RANK, master], env=env, capture_output=True, text=True, timeout=90, check=False
    )
    lines = [line for line in done.stdout.splitlines() if line.startswith("{")]
    assert lines, done.stderr[-2000:]
    result: dict[str, object] = json.loads(lines[-1])
    return result


def test_a_store_over_tcp_needs_a_second_engines_ports_in_the_rank_window(master: str) -> None:
    window = ports_per_rank("tcp", store=True)
    assert window == 2 * ports_per_rank("tcp")
    assert _rank(master, window) == {"pd": 0, "store": 0, "put": 0, "read_back": True}
    short = _rank(master, window - 1)  # the PD engine starts; the Store's engine finds no data port
    assert short["pd"] == 0
    assert short["store"] != 0
