"""Initialize a real Mooncake transfer engine the way SGLang does (P2PHANDSHAKE, local hostname = the pod IP) and
report the outcome as one JSON line; Mooncake's own log goes to stderr. Env: the pod's MC_* variables.

Usage: python mooncake_init.py <ip> <protocol>
"""

from __future__ import annotations

import json
import sys

from mooncake.engine import TransferEngine


def main() -> int:
    ip, protocol = sys.argv[1], sys.argv[2]
    engine = TransferEngine()
    rc = engine.initialize(ip, "P2PHANDSHAKE", protocol, "")
    print(json.dumps({"rc": rc, "rpc_port": int(engine.get_rpc_port()) if rc == 0 else None}), flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
