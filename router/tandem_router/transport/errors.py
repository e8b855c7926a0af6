"""The router's transport failures: one exception type, a reason enum that says whether the worker is gone.

Every failure of the HTTP client (socket errors, timeouts, malformed responses) is mapped here, at the transport
boundary; nothing above it sees a client library's exception. A worker's non-200 answer is not a failure of the
transport: it is returned as a response like any other.
"""

from __future__ import annotations

import enum


class FailureReason(enum.Enum):
    UNREACHABLE = "unreachable"  # connection refused, no route, name not resolved: nothing listens there
    CONNECT_TIMEOUT = "connect_timeout"  # no TCP handshake within the connect timeout
    READ_TIMEOUT = "read_timeout"  # silence longer than the read-idle timeout while a response was due
    CLOSED = "closed"  # the worker closed or reset the connection before its response ended
    PROTOCOL = "protocol"  # what came back is not a valid HTTP/1.1 response

    @property
    def hard(self) -> bool:
        """Hard: the worker process is not there (open its breaker at once); soft: one failure among others."""
        return self is FailureReason.UNREACHABLE


class WorkerError(Exception):
    """The worker could not be reached or broke the exchange."""

    def __init__(self, reason: FailureReason, detail: str) -> None:
        super().__init__(f"{reason.value}: {detail}")
        self.reason = reason
        self.detail = detail

    @property
    def hard(self) -> bool:
        return self.reason.hard
