"""How many ports of ``[MC_MIN_RPC_PORT, MC_MAX_RPC_PORT]`` a worker pod needs. Pure; the API rules and the pod
manifests both build on it (and so can a window that moves by epoch).

SGLang 0.5.23 runs one scheduler process per GPU rank, each with its own Mooncake transfer engine in P2PHANDSHAKE
mode (``MooncakeKVManager.init_engine`` -> ``init_mooncake_transfer_engine`` in
``sglang/srt/distributed/device_communicators/mooncake_transfer_engine.py``); a pod runs ``tpSize / nodesPerGroup``
ranks. Measured with mooncake-transfer-engine 0.3.13 (``tests/operator/test_mooncake_ports.py``,
``tests/test_sim_ranks.py``): every engine takes its RPC port (the session id ``ip:port``) from the range, and the
TCP transport also its data port; RDMA needs no data port. Mooncake refuses a range below 1024 or touching the
kernel's ephemeral ports (Linux's default ``ip_local_port_range`` 32768-60999): it logs "Invalid port range" and
silently uses [15000, 17000].
"""

from __future__ import annotations

MOONCAKE_MIN_PORT = 1024
EPHEMERAL_PORTS = (32768, 60999)  # Linux's default net.ipv4.ip_local_port_range
VALID_RANGES = "1024-32767 or 61000-65535"
MAX_PORTS_PER_POD = 64  # 16 GPUs per node (gpusPerNode's maximum) x 2 ports with tcp x 2 engines with a Store


def ports_per_rank(protocol: str, store: bool = False) -> int:
    """RPC port only (rdma), RPC + TCP data port (tcp); twice that over tcp for a rank with a Mooncake Store.

    A Store (HiCache's L3, decode KV offload) reuses the rank's PD engine only over rdma with P2PHANDSHAKE metadata
    and the same device list (``MooncakeStore.__init__`` in SGLang 0.5.23
    ``sglang/srt/mem_cache/storage/mooncake_store/mooncake_store.py``, which Tandem's pods satisfy); over tcp it
    starts a second engine, whose RPC and data ports come from the same window (measured with the 0.3.13.post1
    wheel: ``tests/test_mooncake_store_ports.py``).
    """
    per_engine = 2 if protocol == "tcp" else 1
    return per_engine * (2 if store and protocol == "tcp" else 1)


def ports_needed(ranks_per_pod: int, protocol: str, store: bool = False) -> int:
    """Ports every rank of one pod needs: the pod's ``MC_MAX_RPC_PORT - MC_MIN_RPC_PORT + 1``."""
    return ranks_per_pod * ports_per_rank(protocol, store)


def ports_needed_cel(gpus_per_node: str, protocol: str, store: str) -> str:
    """``ports_needed`` as a CEL expression over the given CEL field paths (``store``: a CEL boolean)."""
    return f"({gpus_per_node} * ({protocol} == 'tcp' ? 2 : 1) * ({store} && {protocol} == 'tcp' ? 2 : 1))"
