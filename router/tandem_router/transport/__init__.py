"""The seam between the router and its workers (see ``client``): requests out, status/headers/bytes back, and
one error type with a reason enum (``errors``). Nothing above it imports an HTTP client library."""

from tandem_router.transport.client import Request, Transport, TransportConfig, WorkerResponse
from tandem_router.transport.errors import FailureReason, WorkerError

__all__ = ["FailureReason", "Request", "Transport", "TransportConfig", "WorkerError", "WorkerResponse"]
