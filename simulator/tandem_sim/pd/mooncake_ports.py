"""The ports each rank's Mooncake engine takes from ``[MC_MIN_RPC_PORT, MC_MAX_RPC_PORT]``, and the stand-in for RDMA.

Measured with mooncake-transfer-engine 0.3.13 (P2PHANDSHAKE, one process, several engines, as a pod's ranks share
one environment): every engine takes its RPC port from the range (the session id ``ip:port``), and the TCP
transport also takes its data port from it (``TcpTransport: unable to find available tcp port for data
transmission`` otherwise). 8 TCP engines start in a 16-port range; in 15 ports the 8th fails. RDMA needs no data
port, so a rank needs one port (``P2P: No valid port found for local TCP service.`` when none is left).

The simulator always moves bytes over Mooncake's TCP transport. For a pod that declares ``rdma`` it checks the
range as RDMA would use it (one port per rank) and then widens the range of its own stand-in engines by one port
per rank above ``MC_MAX_RPC_PORT`` for their TCP data ports (Mooncake reads the range once, at import, so this
happens before the first engine is made). Session ids of simulated RDMA ranks can therefore lie in that extension.
(The operator sizes pod ranges from the same facts: ``tandem_operator.api.mooncake_ports.ports_needed``.)
"""

from __future__ import annotations

import contextlib
import os
import socket

from tandem_sim.config import MooncakeEnv

RDMA_NO_PORT = "P2P: No valid port found for local TCP service."


def _bindable(host: str, port: int) -> bool:
    family = socket.AF_INET6 if ":" in host else socket.AF_INET
    with socket.socket(family, socket.SOCK_STREAM) as sock, contextlib.suppress(OSError):
        sock.bind((host, port))
        return True
    return False


def free_ports(host: str, low: int, high: int) -> int:
    return sum(_bindable(host, port) for port in range(low, high + 1))


def rdma_ranks_that_start(env: MooncakeEnv, host: str, ranks: int) -> int:
    """How many of ``ranks`` RDMA engines would get an RPC port; widens the stand-in range when all of them do."""
    low, high = env.ports
    started = min(ranks, free_ports(host, low, high))
    if started == ranks:
        os.environ["MC_MAX_RPC_PORT"] = str(high + ranks)
    return started
