"""Initialize real Mooncake transfer engines the way SGLang's ranks do (P2PHANDSHAKE, local hostname = the pod IP,
one engine per GPU rank, all in one environment) and report the outcome as one JSON line; Mooncake's own log goes to
stderr. Env: the pod's MC_* variables.

Usage: python mooncake_init.py <ip> <protocol> [ranks]
"""

from __future__ import annotations

import json
import sys

from mooncake.engine import TransferEngine


def main() -> int:
    ip, protocol = sys.argv[1], sys.argv[2]
    ranks = int(sys.argv[3]) if len(sys.argv) > 3 else 1
    engines, codes, ports = [], [], []
    for _ in range(ranks):
        engine = TransferEngine()
        rc = engine.initialize(ip, "P2PHANDSHAKE", protocol, "")
        codes.append(rc)
        ports.append(int(engine.get_rpc_port()) if rc == 0 else None)
        engines.append(engine)
    print(json.dumps({"rc": codes[0], "rcs": codes, "rpc_port": ports[0], "rpc_ports": ports}), flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
