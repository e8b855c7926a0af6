"""Who sent a request: the one identity the router gives a client, for integrity evidence (one client's findings
alone never quarantine a pair) and for flow control (a tenant's share, queue and limits).

In order: the API key when the router checks keys (``api_keys``; an unchecked token could be made up per request),
as ``key:`` + the first 16 hex digits of its SHA-256; else the value of ``client_id_header`` when the router's
operator named one (a header that a trusted proxy in front of the router sets; without that setting no header is
read, so a client cannot claim another tenant's identity), as ``header:<value>``; else ``peer:<address>``.
"""

from __future__ import annotations

import hashlib

from tandem_router.config import RouterSettings
from tandem_router.server import ServerRequest

HEADER_VALUE_CHARS = 256


def key_identity(key: str) -> str:
    """The identity of API key ``key`` (what a limits file names): ``key:`` + 16 hex digits of its SHA-256."""
    return "key:" + hashlib.sha256(key.encode()).hexdigest()[:16]


def client_identity(request: ServerRequest, settings: RouterSettings) -> str:
    header = request.header("authorization")
    if settings.api_keys and header[:7].lower() == "bearer " and header[7:]:
        return key_identity(header[7:])
    if settings.client_id_header:
        value = request.header(settings.client_id_header)
        if value:
            return "header:" + value[:HEADER_VALUE_CHARS]
    return f"peer:{request.remote or 'unknown'}"
