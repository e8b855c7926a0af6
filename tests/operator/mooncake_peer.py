"""A real Mooncake transfer engine that publishes its metadata in etcd, then idles (a pod's worker, for tests).

Usage: python mooncake_peer.py <local_hostname> <etcd host:port>. Env: MC_METADATA_CLUSTER_ID (and any MC_*).
"""

from __future__ import annotations

import sys
import time

import numpy as np
from mooncake.engine import TransferEngine


def main() -> int:
    name, etcd = sys.argv[1], sys.argv[2]
    engine = TransferEngine()
    rc = engine.initialize(name, f"etcd://{etcd}", "tcp", "")
    if rc != 0:
        print(f"initialize failed: {rc}", flush=True)
        return 1
    buffer = np.zeros(1 << 16, dtype=np.uint8)
    if engine.register_memory(buffer.ctypes.data, buffer.nbytes) != 0:
        print("register_memory failed", flush=True)
        return 1
    print("READY", flush=True)
    while True:
        time.sleep(1)


if __name__ == "__main__":
    sys.exit(main())
