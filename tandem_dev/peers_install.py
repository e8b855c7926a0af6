"""``make peers``: install the pinned peers (``tandem_dev.peers``) that are missing, or check them (``status``),
one installer at a time per cache; the cold install times go to ``build/records/peers-install.json``."""

from __future__ import annotations

import argparse
import fcntl
import sys
import time
from collections.abc import Sequence

from tandem_dev import peers, records


def main(argv: Sequence[str]) -> int:
    parser = argparse.ArgumentParser(prog="python -m tandem_dev.peers_install", description=__doc__)
    parser.add_argument("command", choices=["install", "status"])
    parser.add_argument("peers", nargs="*", help=f"default: all ({', '.join(peers.PEERS)})")
    args = parser.parse_args(argv)
    unknown = [p for p in args.peers if p not in peers.PEERS]
    if unknown:
        parser.error(f"unknown peer(s): {', '.join(unknown)}; known: {', '.join(peers.PEERS)}")
    missing = 0
    installed_s: dict[str, float] = {}
    (peers.CACHE / "peers").mkdir(parents=True, exist_ok=True)
    with (peers.CACHE / "peers" / ".lock").open("w") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)  # one installer at a time per cache (worktrees share it)
        for name in args.peers or list(peers.PEERS):
            missing += not _install_or_check(peers.PEERS[name], args.command == "install", installed_s)
    if installed_s:  # the cold install times README.md's peers table shows
        saved = records.save(
            "peers-install", {"install_s": installed_s}, ["python", "-m", "tandem_dev.peers_install", *argv]
        )
        print(f"peers: install times saved to {saved}", flush=True)
    return 1 if missing else 0


def _install_or_check(peer: peers.Peer, install: bool, installed_s: dict[str, float]) -> bool:
    if install and peer.locate() is None:
        started = time.monotonic()
        print(f"peers: installing {peer.name} ({peer.version()}) ...", flush=True)
        peer.install()
        installed_s[peer.name] = round(time.monotonic() - started, 1)
        print(f"peers: {peer.name} installed in {installed_s[peer.name]:.0f}s", flush=True)
    found = peer.locate()
    print(f"peers: {peer.name} {peer.version()}: {found if found else 'NOT INSTALLED: ' + peer.how}", flush=True)
    return found is not None


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
