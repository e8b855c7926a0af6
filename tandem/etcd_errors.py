"""The one error type of the etcd adapter: every etcd call that fails raises an ``EtcdError``.

``tandem.registry_etcd.Client`` (the client every component gets from ``registry_etcd.client``) translates aetcd's
and gRPC's exceptions with ``as_etcd_errors``; ``tandem.leased_writer`` cuts its calls with ``answered_within``.
The message names the operation and the endpoint; ``__cause__`` keeps the client's own exception. Callers whose
answer to "etcd away" is "try again later" catch ``EtcdError``; two subclasses tell apart what callers act on:

- ``EtcdUnavailableError``: etcd did not answer (connection refused or reset, no member reachable, no leader:
  quorum lost, a deadline passed). It may answer later.
- ``LeaseNotFoundError``: etcd answered that the lease is gone (it expired while etcd was frozen or partitioned, or
  it was revoked): the writer grants a new one and puts its keys again.

Any other failure (etcd refused the request: unauthenticated, permission denied, an invalid request; or the client's
TLS files could not be read) is a plain ``EtcdError``. ``asyncio.CancelledError`` is never translated, nor is an
exception that is no failure of the etcd client (a bug stays a bug).
"""

from __future__ import annotations

import asyncio
import contextlib
from collections.abc import AsyncIterator, Iterator

import grpc
from aetcd import exceptions as aetcd_errors

# gRPC codes of an etcd that did not answer (etcd answers "no leader", "leader changed" and "request timed out" with
# UNAVAILABLE too: the request did not go through, it may later).
_NO_ANSWER = frozenset({grpc.StatusCode.UNAVAILABLE, grpc.StatusCode.DEADLINE_EXCEEDED})
# aetcd's own exceptions for the same (ConnectionFailed: UNAVAILABLE, ConnectionTimeout: DEADLINE_EXCEEDED; a watch
# not created in time), some raised with no gRPC error as their cause.
_AETCD_NO_ANSWER = (
    aetcd_errors.ConnectionFailedError,
    aetcd_errors.ConnectionTimeoutError,
    aetcd_errors.WatchTimeoutError,
)
_CLIENT_FAILURES = (aetcd_errors.ClientError, grpc.aio.AioRpcError, OSError)  # OSError includes TimeoutError


class EtcdError(Exception):
    """An etcd call that failed: ``operation`` (the client's method, e.g. ``put``) at ``endpoint``."""

    def __init__(self, operation: str, endpoint: str, detail: str) -> None:
        super().__init__(f"etcd {operation} at {endpoint}: {detail}")
        self.operation, self.endpoint, self.detail = operation, endpoint, detail


class EtcdUnavailableError(EtcdError):
    """etcd did not answer; it may later."""


class LeaseNotFoundError(EtcdError):
    """etcd answered that the lease no longer exists (expired or revoked)."""


def etcd_error(err: Exception, operation: str, endpoint: str) -> EtcdError:
    """The ``EtcdError`` that ``err`` means: an exception of aetcd, of gRPC or an ``OSError`` (``TimeoutError``
    included) that an etcd client call raised."""
    rpc = err if isinstance(err, grpc.aio.AioRpcError) else err.__cause__
    code = rpc.code() if isinstance(rpc, grpc.aio.AioRpcError) else None
    detail = _detail(err, rpc, code)
    if "lease not found" in detail:  # etcd's NOT_FOUND "etcdserver: requested lease not found"
        return LeaseNotFoundError(operation, endpoint, detail)
    if code in _NO_ANSWER or isinstance(err, (*_AETCD_NO_ANSWER, TimeoutError, ConnectionError)):
        return EtcdUnavailableError(operation, endpoint, detail)
    return EtcdError(operation, endpoint, detail)


def _detail(err: Exception, rpc: BaseException | None, code: grpc.StatusCode | None) -> str:
    if code is not None and isinstance(rpc, grpc.aio.AioRpcError):
        return f"{code.name}: {rpc.details()}"
    if isinstance(err, TimeoutError) and not str(err):
        return "no answer in time"
    return f"{type(err).__name__}: {err}" if str(err) else type(err).__name__


@contextlib.contextmanager
def as_etcd_errors(operation: str, endpoint: str) -> Iterator[None]:
    """Raise what an etcd client call in the block raises as the ``EtcdError`` it means (from the original)."""
    try:
        yield
    except _CLIENT_FAILURES as err:
        raise etcd_error(err, operation, endpoint) from err


@contextlib.asynccontextmanager
async def answered_within(seconds: float, operation: str, endpoint: str) -> AsyncIterator[None]:
    """Cut the etcd call in the block at ``seconds`` (aetcd's call to a frozen etcd otherwise waits for the
    client's whole timeout): ``EtcdUnavailableError`` when it did not answer in time."""
    try:
        async with asyncio.timeout(seconds):
            yield
    except TimeoutError as err:
        raise EtcdUnavailableError(operation, endpoint, f"no answer within {seconds}s") from err
