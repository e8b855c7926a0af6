"""The router's client-facing HTTP/1.1 server (asyncio protocol, llhttp request parsing): see ``protocol``."""

from tandem_router.server.messages import Headers, Reply, Response, ResponseStream, ServerRequest
from tandem_router.server.protocol import Handler, Limits, error_reply
from tandem_router.server.server import HttpServer

__all__ = [
    "Handler",
    "Headers",
    "HttpServer",
    "Limits",
    "Reply",
    "Response",
    "ResponseStream",
    "ServerRequest",
    "error_reply",
]
