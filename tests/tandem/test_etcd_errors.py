"""``tandem.etcd_errors``: which failure of the etcd client becomes which ``EtcdError``, and the client that raises
them (``tandem.registry_etcd.Client``)."""

from __future__ import annotations

import asyncio
import re
from collections.abc import AsyncIterator
from typing import Any

import aetcd
import grpc
import pytest
from aetcd import exceptions as aetcd_errors
from aetcd import rtypes

from tandem.etcd_errors import (
    EtcdError,
    EtcdUnavailableError,
    LeaseNotFoundError,
    answered_within,
    as_etcd_errors,
    etcd_error,
)
from tandem.registry_etcd import client, close_client


def _rpc_error(code: grpc.StatusCode, details: str) -> grpc.aio.AioRpcError:
    return grpc.aio.AioRpcError(code, grpc.aio.Metadata(), grpc.aio.Metadata(), details=details)


def _from_aetcd(code: grpc.StatusCode, details: str) -> Exception:
    """What an aetcd call raises when its RPC fails with ``code`` (aetcd's own translation)."""
    try:
        aetcd_errors._handle_exception(_rpc_error(code, details))
    except Exception as err:
        return err
    raise AssertionError("aetcd raised nothing")


LEASE_NOT_FOUND = "etcdserver: requested lease not found"
UNAVAILABLE = "failed to connect to all addresses; last error: UNKNOWN: ipv4:127.0.0.1:2379: Connection refused"


@pytest.mark.parametrize(
    ("raised", "kind", "detail"),
    [
        # etcd did not answer
        (_rpc_error(grpc.StatusCode.UNAVAILABLE, UNAVAILABLE), EtcdUnavailableError, f"UNAVAILABLE: {UNAVAILABLE}"),
        (_from_aetcd(grpc.StatusCode.UNAVAILABLE, "etcdserver: no leader"), EtcdUnavailableError, "no leader"),
        (
            _from_aetcd(grpc.StatusCode.DEADLINE_EXCEEDED, "Deadline Exceeded"),
            EtcdUnavailableError,
            "DEADLINE_EXCEEDED",
        ),
        (aetcd_errors.ConnectionTimeoutError("deadline"), EtcdUnavailableError, "ConnectionTimeoutError: deadline"),
        (aetcd_errors.WatchTimeoutError(), EtcdUnavailableError, "WatchTimeoutError"),
        (TimeoutError(), EtcdUnavailableError, "no answer in time"),
        (ConnectionRefusedError(111, "Connection refused"), EtcdUnavailableError, "Connection refused"),
        # etcd answered: the lease is gone
        (
            _from_aetcd(grpc.StatusCode.NOT_FOUND, "etcdserver: requested lease not found"),
            LeaseNotFoundError,
            "NOT_FOUND",
        ),
        # etcd answered: refused, or something else went wrong
        (_from_aetcd(grpc.StatusCode.PERMISSION_DENIED, "etcdserver: permission denied"), EtcdError, "permission"),
        (_from_aetcd(grpc.StatusCode.UNAUTHENTICATED, "etcdserver: invalid auth token"), EtcdError, "UNAUTHENTICATED"),
        (_from_aetcd(grpc.StatusCode.INVALID_ARGUMENT, "etcdserver: key is not provided"), EtcdError, "key is not"),
        (_rpc_error(grpc.StatusCode.CANCELLED, "Channel closed!"), EtcdError, "CANCELLED: Channel closed!"),
        (aetcd_errors.RevisionCompactedError(7), EtcdError, "compacted below 7"),
        (aetcd_errors.DuplicateLeaseError(), EtcdError, "DuplicateLeaseError"),
        (FileNotFoundError(2, "No such file or directory", "/tls/ca.crt"), EtcdError, "/tls/ca.crt"),
    ],
)
def test_each_client_failure_becomes_the_error_its_callers_act_on(
    raised: Exception, kind: type[EtcdError], detail: str
) -> None:
    err = etcd_error(raised, "put", "etcd-0:2379,etcd-1:2379")
    assert type(err) is kind
    assert detail in err.detail
    assert str(err).startswith("etcd put at etcd-0:2379,etcd-1:2379: ")
    assert (err.operation, err.endpoint) == ("put", "etcd-0:2379,etcd-1:2379")


def test_the_client_exception_is_the_cause_and_what_is_no_client_failure_passes_unchanged() -> None:
    refused = _from_aetcd(grpc.StatusCode.UNAVAILABLE, UNAVAILABLE)
    with pytest.raises(EtcdUnavailableError) as caught, as_etcd_errors("get_prefix", "etcd:2379"):
        raise refused
    assert caught.value.__cause__ is refused
    assert isinstance(refused.__cause__, grpc.aio.AioRpcError)

    already = LeaseNotFoundError("put", "etcd:2379", f"NOT_FOUND: {LEASE_NOT_FOUND}")
    for unchanged in (ValueError("a bug"), already):
        with pytest.raises(type(unchanged)) as passed, as_etcd_errors("put", "etcd:2379"):
            raise unchanged
        assert passed.value is unchanged


async def test_a_call_cut_short_is_etcd_unavailable_and_a_cancellation_stays_one() -> None:
    with pytest.raises(EtcdUnavailableError, match=r"etcd refresh_lease at etcd:2379: no answer within 0.01s"):
        async with answered_within(0.01, "refresh_lease", "etcd:2379"):
            await asyncio.sleep(10)

    async def refresh() -> None:
        async with answered_within(10, "refresh_lease", "etcd:2379"):
            await asyncio.sleep(10)

    task = asyncio.create_task(refresh())
    await asyncio.sleep(0)
    task.cancel()
    with pytest.raises(asyncio.CancelledError):
        await task


async def test_the_client_raises_etcd_unavailable_naming_the_call_and_the_endpoints() -> None:
    etcd = client(["127.0.0.1:1"], timeout=2)  # nothing listens there
    try:
        with pytest.raises(EtcdUnavailableError, match=r"^etcd put at 127\.0\.0\.1:1: ") as caught:
            await etcd.put(b"k", b"v")
        assert isinstance(caught.value.__cause__, aetcd_errors.ClientError)
        with pytest.raises(EtcdUnavailableError, match=r"^etcd watch at 127\.0\.0\.1:1: "):
            await etcd.watch_prefix(b"k")
    finally:
        await close_client(etcd)


async def test_a_watch_that_breaks_raises_an_etcd_error(monkeypatch: pytest.MonkeyPatch) -> None:
    """A watch stream that fails after its first event (the member serving it killed): the event arrives, then
    ``EtcdUnavailableError``."""
    lost = _from_aetcd(grpc.StatusCode.UNAVAILABLE, "Socket closed")

    async def breaks(self: Any, *args: Any, **kwargs: Any) -> rtypes.Watch:
        async def events() -> AsyncIterator[str]:
            yield "event"
            raise lost

        async def cancel() -> None:
            return None

        return rtypes.Watch(events, cancel, 1)

    monkeypatch.setattr(aetcd.Client, "watch", breaks)
    watch = await client(["127.0.0.1:1", "127.0.0.2:1"]).watch_prefix(b"k")
    seen = []

    async def follow() -> None:
        async for event in watch:
            seen.append(event)

    endpoints = re.escape("127.0.0.1:1,127.0.0.2:1")
    with pytest.raises(EtcdUnavailableError, match=rf"^etcd watch at {endpoints}: UNAVAILABLE") as caught:
        await follow()
    assert seen == ["event"]
    assert caught.value.__cause__ is lost
