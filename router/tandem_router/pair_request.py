"""One non-streaming request through exactly this (prefill, decode) pair, outside the client path.

Used by the integrity checks (canaries, shadow comparison): fresh bootstrap fields, the body to both workers at
once, the decode's texts back. Any failure to answer is ``None``: reachability is the breakers' business.
"""

from __future__ import annotations

import asyncio
import logging
import random
from typing import Any

import orjson

from tandem_router.integrity.textextract import body_texts
from tandem_router.policy import bootstrap
from tandem_router.pool import Pair
from tandem_router.transport import Request, Transport, WorkerError

log = logging.getLogger("tandem.router.integrity")


async def texts_from_pair(
    transport: Transport,
    pair: Pair,
    path: str,
    body: dict[str, Any],
    *,
    rng: random.Random,
    request_id: str,
    timeout_s: float,
) -> list[str] | None:
    data = orjson.dumps(
        bootstrap.inject(
            {**body, "stream": False},
            host=bootstrap.bootstrap_host(pair.prefill.url),
            port=pair.prefill.bootstrap_port,
            items=0,
            rng=rng,
            dp_size=pair.prefill.attn_dp_size,
        )
    )
    request = Request.build("POST", path, data, {"Content-Type": "application/json", "X-Request-Id": request_id})

    async def post(url: str) -> tuple[int, bytes]:
        async with await transport.open(url, request) as resp:
            return resp.status, await resp.read()

    try:
        async with asyncio.timeout(timeout_s):
            (p_status, _), (d_status, d_body) = await asyncio.gather(post(pair.prefill.url), post(pair.decode.url))
    except (TimeoutError, WorkerError) as err:
        log.info("integrity request not answered", extra={"request_id": request_id, "error": repr(err)})
        return None
    if p_status != 200 or d_status != 200:
        return None
    return body_texts(path, d_body)
