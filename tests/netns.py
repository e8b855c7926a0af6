"""Is this process in a loopback-only network namespace (``scripts/in-netns.sh``)?

``socket.if_nameindex()`` asks the kernel (netlink) for the interfaces of the calling process's own network
namespace. ``/sys/class/net`` is no test: sysfs shows the namespace of whoever mounted it, so after a bare
``unshare -n`` it still lists the host's ``eth0``.
"""

from __future__ import annotations

import socket

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
