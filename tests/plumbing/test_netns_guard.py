"""The suite refuses ``netns`` tests and sysctl writes outside a loopback-only network namespace."""

from __future__ import annotations

import socket

import pytest

from tests.plumbing import netns
from tests.plumbing.markfilter import UNUSED_IN_UNIT_PLUGINS

HOST_INTERFACES = [(1, "lo"), (2, "eth0")]


def test_a_namespace_with_only_lo_is_loopback_only(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(socket, "if_nameindex", lambda: [(1, "lo")])
    assert netns.loopback_only()
    monkeypatch.setattr(socket, "if_nameindex", lambda: HOST_INTERFACES)
    assert not netns.loopback_only()


def test_a_sysctl_write_is_refused_on_the_host(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(socket, "if_nameindex", lambda: HOST_INTERFACES)
    refused = r"refusing writing /proc/sys/net/ipv4/tcp_max_tw_buckets .* eth0, lo"
    with pytest.raises(RuntimeError, match=refused):
        netns.require_loopback_only("writing /proc/sys/net/ipv4/tcp_max_tw_buckets")


NETNS_TEST = """
import pytest

@pytest.mark.netns
def test_needs_the_namespace():
    pass

def test_pure():
    pass
"""

INNER_ARGS = ("-p", "no:cacheprovider", "-p", "no:asyncio", *UNUSED_IN_UNIT_PLUGINS, "-o", "markers=netns: x")


@pytest.mark.parametrize(("interfaces", "outcome"), [(HOST_INTERFACES, 4), ([(1, "lo")], 0)])
def test_the_session_refuses_netns_tests_on_the_host(
    pytester: pytest.Pytester, monkeypatch: pytest.MonkeyPatch, interfaces: list[tuple[int, str]], outcome: int
) -> None:
    monkeypatch.setattr(socket, "if_nameindex", lambda: interfaces)
    pytester.makeconftest("from tests.conftest import pytest_collection_finish")
    pytester.makepyfile(NETNS_TEST)
    result = pytester.runpytest(*INNER_ARGS)
    assert result.ret == outcome
    if outcome:
        result.stdout.fnmatch_lines(["*1 selected test(s) are marked netns*eth0, lo, not only lo*in-netns.sh*"])
    deselected = pytester.runpytest(*INNER_ARGS, "-m", "not netns")
    assert deselected.ret == 0
