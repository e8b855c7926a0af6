"""Sampled shadow comparison: re-run a finished deterministic request on a second pair and compare the answers.

A deterministic request (temperature 0, or an explicit seed) gives the same text on every healthy pair up to GPU
numerics: without ``--enable-deterministic-inference`` a near-tied token may flip with the batch and the rest of
the answer diverge (``integrity.divergence``). For a sampled fraction of them (``rate``), a copy of the body that
asks for the top-two logprobs goes to a second pair, with a new bootstrap room, after the client got its answer
(the client's response is untouched). An answer SAME or NUMERICAL with the client's counts as agreement
(``tandem_integrity_shadows_total{result="match"|"numerical"}``); a DIFFERENT one goes to a third pair, and the pair
whose answer is DIFFERENT from the third while the other agrees with it gets an integrity failure. No third pair,
or a third that agrees with both or neither: nobody is blamed. At most ``max_in_flight`` shadows run at once, so
the extra load stays bounded whatever the traffic.

Clients cannot make their own requests look like corruption or like numerics: the answers compared are the same
request's on different pairs, the client's one enters as the text it was sent, and the logprobs come only from the
re-runs the router makes.

The same comparison *confirms* a detector finding (``confirm``): the suspect request itself is re-run on two other
pairs, preferably ones that share no worker with the suspect pair. A client that provoked the finding with its
own prompt gets the same answer everywhere (up to numerics), so nothing is blamed; a garbling pair is in the
minority.
"""

from __future__ import annotations

import asyncio
import logging
import random
import time
from typing import Any

from tandem_router.integrity.divergence import Answer, compare
from tandem_router.integrity.monitor import IntegrityMonitor
from tandem_router.pair_request import answers_from_pair
from tandem_router.pool import Pair, WorkerPool
from tandem_router.proxy import ProxyRequest
from tandem_router.transport import Transport

log = logging.getLogger("tandem.router.shadow")


def deterministic(body: dict[str, Any]) -> bool:
    """Temperature 0 or a fixed seed, in SGLang's native or the OpenAI spelling."""
    params = body.get("sampling_params")
    if not isinstance(params, dict):
        params = body
    if params.get("sampling_seed") is not None or params.get("seed") is not None:
        return True
    return bool(params.get("temperature", 1.0) == 0)


async def rerun(
    transport: Transport, pair: Pair, req: ProxyRequest, tag: str, rng: random.Random, timeout_s: float = 60.0
) -> Answer | None:
    """The answer (text and top-two logprobs) of a client request re-run through exactly ``pair`` (None if it
    could not answer, or not one)."""
    answers = await answers_from_pair(
        transport, pair, req.route.value, req.body, rng=rng, request_id=f"{tag}-{req.request_id}", timeout_s=timeout_s
    )
    return answers[0] if answers is not None and len(answers) == 1 else None


class ShadowSampler:
    def __init__(
        self,
        monitor: IntegrityMonitor,
        transport: Transport,
        pool: WorkerPool,
        rate: float,
        max_in_flight: int = 4,
        rng: random.Random | None = None,
        max_confirming: int = 16,
    ) -> None:
        self.monitor, self.transport, self.pool = monitor, transport, pool
        self.rate, self.max_in_flight, self.max_confirming = rate, max_in_flight, max_confirming
        self.rng = rng or random.Random()
        self._tasks: set[asyncio.Task[None]] = set()
        self._confirming: set[asyncio.Task[None]] = set()

    def confirm(self, pair: Pair, req: ProxyRequest, text: str) -> None:
        """Re-run a suspect deterministic request on two other pairs (its own budget, ``max_confirming``)."""
        if len(self._confirming) >= self.max_confirming:
            return
        task = asyncio.create_task(self._compare(pair, req, text))
        self._confirming.add(task)
        task.add_done_callback(self._confirming.discard)

    def completed(self, pair: Pair, req: ProxyRequest, outputs: list[str]) -> None:
        """Called by the proxy when a response reached the client in full."""
        if (
            self.rate <= 0
            or len(self._tasks) >= self.max_in_flight
            or req.items != 0
            or len(outputs) != 1
            or not deterministic(req.body)
            or self.rng.random() >= self.rate
        ):
            return
        task = asyncio.create_task(self._compare(pair, req, outputs[0]))
        self._tasks.add(task)
        task.add_done_callback(self._tasks.discard)

    async def drain(self) -> None:
        await asyncio.gather(*self._tasks, *self._confirming, return_exceptions=True)

    def _other_pair(self, req: ProxyRequest, avoid: list[Pair]) -> Pair | None:
        """A pair other than ``avoid``, preferring one whose decode none of them uses."""
        keys = frozenset(p.key for p in avoid)
        decodes = {p.decode.key for p in avoid}
        sharing = frozenset(p.key for p in self.pool.all_pairs() if p.decode.key in decodes)
        now = time.monotonic()
        pair = self.pool.choose_pair(req.prefix, now, keys | sharing) or self.pool.choose_pair(req.prefix, now, keys)
        return None if pair is None or pair.key in keys else pair

    async def _compare(self, original: Pair, req: ProxyRequest, text: str) -> None:
        second = self._other_pair(req, [original])
        if second is None:
            return
        other = await self._run(second, req)
        if other is None:
            return
        near_tie = self.monitor.cfg.near_tie_nats
        client = Answer(text)
        verdict = compare(client, other, near_tie)
        self.monitor.shadow_result(verdict.kind)
        if verdict.agrees:
            return
        third = self._other_pair(req, [original, second])
        if third is None:
            log.info("shadow mismatch without a third pair to break the tie", extra={"request_id": req.request_id})
            return
        tie = await self._run(third, req)
        if tie is None:
            return
        with_client, with_other = compare(tie, client, near_tie).agrees, compare(tie, other, near_tie).agrees
        if with_other and not with_client:
            self.monitor.failure(original.key, f"shadow: text differs from two other pairs ({text[:60]!r})")
        elif with_client and not with_other:
            self.monitor.failure(second.key, f"shadow: text differs from two other pairs ({other.text[:60]!r})")

    async def _run(self, pair: Pair, req: ProxyRequest) -> Answer | None:
        return await rerun(self.transport, pair, req, "shadow", self.rng)
