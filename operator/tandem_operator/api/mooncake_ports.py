"""How many ports of ``[MC_MIN_RPC_PORT, MC_MAX_RPC_PORT]`` a worker pod needs. Pure; the API rules and the pod
manifests both build on it (and so can a window that moves by epoch).

SGLang 0.5.23 runs one scheduler process per GPU rank, each with its own Mooncake transfer engine in P2PHANDSHAKE
mode (``MooncakeKVManager.init_engine`` -> ``init_mooncake_transfer_engine`` in
``sglang/srt/distributed/device_communicators/mooncake_transfer_engine.py``); a pod runs ``tpSize / nodesPerGroup``
ranks. Measured with mooncake-transfer-engine 0.3.13 (``tests/operator/test_mooncake_ports.py``,
``tests/sim/test_ranks.py``): every engine takes its RPC port (the session id ``ip:port``) from the range, and the
TCP transport also its data port; RDMA needs no data port. Mooncake refuses a range below 1024 or touching the
kernel's ephemeral ports (Linux's default ``ip_local_port_range`` 32768-60999): it logs "Invalid port range" and
silently uses [15000, 17000].
"""

from __future__ import annotations

MOONCAKE_MIN_PORT = 1024
EPHEMERAL_PORTS = (32768, 60999)  # Linux's default net.ipv4.ip_local_port_range
VALID_RANGES = "1024-32767 or 61000-65535"
# 16 GPUs per node (gpusPerNode's maximum) x 2 ports with tcp x 3 engines (PD, a Mooncake Store's, the weights')
MAX_PORTS_PER_POD = 96


def ports_per_rank(protocol: str, store: bool = False, weights: bool = False) -> int:
    """RPC port only (rdma), RPC + TCP data port (tcp), per engine; a rank has its PD engine, a second one over tcp
    with a Mooncake Store, and one more for its weights with peer loading (``weights``).

    A Store (HiCache's L3, decode KV offload) reuses the rank's PD engine only over rdma with P2PHANDSHAKE metadata
    and the same device list (``MooncakeStore.__init__`` in SGLang 0.5.23
    ``sglang/srt/mem_cache/storage/mooncake_store/mooncake_store.py``, which Tandem's pods satisfy); over tcp it
    starts a second engine, whose RPC and data ports come from the same window (measured with the 0.3.13.post1
    wheel: ``tests/operator/test_mooncake_store_ports.py``).

    With peer loading (``spec.peerLoading``) SGLang gives each rank a weight transfer engine of its own, seed and
    peer alike (``remote_instance_weight_transporter.py``: ``init_engine``, P2PHANDSHAKE, before loading), which
    takes its ports from the same range (``tandem_sim``'s loader checks it as for the PD engine).
    """
    per_engine = 2 if protocol == "tcp" else 1
    return per_engine * (1 + int(store and protocol == "tcp") + int(weights))


def ports_needed(ranks_per_pod: int, protocol: str, store: bool = False, weights: bool = False) -> int:
    """Ports every rank of one pod needs: the pod's ``MC_MAX_RPC_PORT - MC_MIN_RPC_PORT + 1``."""
    return ranks_per_pod * ports_per_rank(protocol, store, weights)


def ports_needed_cel(gpus_per_node: str, protocol: str, store: str, weights: str = "false") -> str:
    """``ports_needed`` as a CEL expression over the given CEL field paths (``store``, ``weights``: CEL booleans)."""
    engines = f"(1 + ({store} && {protocol} == 'tcp' ? 1 : 0) + ({weights} ? 1 : 0))"
    return f"({gpus_per_node} * ({protocol} == 'tcp' ? 2 : 1) * {engines})"
