"""Is this process in a loopback-only network namespace (``scripts/in-netns.sh``)?

``socket.if_nameindex()`` asks the kernel (netlink) for the interfaces of the calling process's own network
namespace. ``/sys/class/net`` is no test: sysfs shows the namespace of whoever mounted it, so after a bare
``unshare -n`` it still lists the host's ``eth0``.
"""

from __future__ import annotations

import ctypes
import os
import socket
import subprocess

HOW = "run the suite through scripts/in-netns.sh (as `make test` does), or deselect these tests with -m 'not netns'"


def interfaces() -> list[str]:
    return sorted(name for _index, name in socket.if_nameindex())


def loopback_only() -> bool:
    return interfaces() == ["lo"]


def require_loopback_only(what: str) -> None:
    """Refuse ``what`` (a sysctl write, Mooncake processes ...) outside a loopback-only network namespace."""
    if not loopback_only():
        raise RuntimeError(f"refusing {what} outside a loopback-only network namespace (this one has "
                           f"{', '.join(interfaces())}): {HOW}")  # fmt: skip


CLONE_NEWNET = 0x40000000  # <sched.h>


def enter_own() -> None:
    """Move the calling thread into a new network namespace with only loopback, up (``unshare -n``, then ``ip link
    set lo up``): what ``scripts/in-netns.sh`` gives the suite, given to one pytest-xdist worker, so that the
    workers' servers, fixed ports and addresses (127.0.0.2, a Mooncake port window, the dev cluster's bridge)
    never meet. A namespace belongs to a thread: threads and processes started from this one after the call are
    in it, threads started before stay where they were (pytest-xdist runs the tests in the main thread)."""
    libc = ctypes.CDLL(None, use_errno=True)
    if libc.unshare(CLONE_NEWNET) != 0:
        err = ctypes.get_errno()
        raise OSError(err, f"unshare(CLONE_NEWNET) for this worker's own network namespace: {os.strerror(err)}")
    subprocess.run(["ip", "link", "set", "lo", "up"], check=True)
    if not loopback_only():
        raise RuntimeError(f"a new network namespace should have only lo, this one has {', '.join(interfaces())}")
