"""One non-streaming request through exactly this (prefill, decode) pair, outside the client path.

Used by the integrity checks (canaries, shadow and confirmation re-runs, probation mirrors, tie-breaks): fresh
bootstrap fields, a copy of the body that asks for the top-two logprobs of every output token
(``divergence.with_logprobs``: comparisons tell numerics from corruption with them) to both workers at once, the
decode's answers back. Any failure to answer is ``None``: reachability is the breakers' business.
"""

from __future__ import annotations

import asyncio
import logging
import random
from typing import Any

import orjson

from tandem_router.integrity.divergence import Answer, body_answers, with_logprobs
from tandem_router.policy import bootstrap
from tandem_router.pool import Pair
from tandem_router.transport import Request, Transport, WorkerError

log = logging.getLogger("tandem.router.integrity")


async def answers_from_pair(
    transport: Transport,
    pair: Pair,
    path: str,
    body: dict[str, Any],
    *,
    rng: random.Random,
    request_id: str,
    timeout_s: float,
) -> list[Answer] | None:
    data = orjson.dumps(
        bootstrap.inject(
            {**with_logprobs(path, body), "stream": False},
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
    return body_answers(path, d_body)


async def known_answer(
    transport: Transport,
    pair: Pair,
    prompt: str,
    *,
    max_new_tokens: int,
    seed: int,
    rng: random.Random,
    label: str,
    timeout_s: float,
) -> Answer | None:
    """A known-answer probe (canaries, race bursts): ``prompt`` through SGLang's ``/generate`` at temperature 0 with
    a fixed ``sampling_seed`` (SGLang 0.5.23 SamplingParams); the decode's one answer, or None."""
    params = {"temperature": 0.0, "max_new_tokens": max_new_tokens, "sampling_seed": seed}
    answers = await answers_from_pair(
        transport,
        pair,
        "/generate",
        {"text": prompt, "sampling_params": params},
        rng=rng,
        request_id=f"{label}-{rng.getrandbits(48):x}",
        timeout_s=timeout_s,
    )
    return answers[0] if answers is not None and len(answers) == 1 else None
