"""A decode killed under temperature-0 ``/generate`` streams with the workers' default, batch-variant numerics.

Without ``--enable-deterministic-inference`` a resumed stream cannot be token-exact: its continuation runs in
other batches than the uninterrupted answer would have, and a near-tied token may flip. What resume must still
guarantee, checked on every stream by its output token ids: no error, one stream id, a token count equal to the
ids relayed, no repeated or missing token at the seam, and a text the model would produce: every token is the
step's top-1 or, at a near-tie, its runner-up, given the prompt and the tokens before it
(``tandem_sim.model.calibration.off_path``, the simulator's own model evaluated in the test).
"""

from __future__ import annotations

import asyncio
import signal
from pathlib import Path
from typing import Any

import aiohttp
import openai
import pytest

from tandem.registry import Role
from tandem_dev.local_stack import LocalStack
from tandem_dev.stack_fixture import running_stack
from tandem_router.openai.schema import Route
from tandem_sim.model import model
from tandem_sim.model.calibration import off_path
from tests.plumbing.routermetrics import scrape
from tests.router.streams import Outcome, stream
from tests.router.test_chaos_sim import FAST_PD_ENV, MAX_TOKENS, default_numerics_sim, time_to_kill

pytestmark = [pytest.mark.netns, pytest.mark.timeout(300)]

STREAMS = 48


def _body(i: int) -> dict[str, Any]:
    """Rare vocabulary words: token ids decode back to the same words, and answers run long."""
    words = [model.vocabulary()[model.COMMON_WORDS_END + (i * 37 + k * 11) % 3000] for k in range(12)]
    prompt: dict[str, Any] = {"text": " ".join(words)} if i % 2 else {"input_ids": model.tokenize(" ".join(words)).ids}
    return {**prompt, "sampling_params": {"max_new_tokens": MAX_TOKENS, "temperature": 0}}


def _prompt(body: dict[str, Any]) -> model.Tokens:
    return model.tokenize(body["text"]) if "text" in body else model.from_ids(body["input_ids"])


def test_a_resumed_stream_is_a_seamless_valid_continuation_under_default_numerics(tmp_path: Path) -> None:
    with running_stack(
        tmp_path, router_port=0, worker_argv=default_numerics_sim, restart=False, deregister_dead=False,
        worker_env=FAST_PD_ENV, router_args=["--retry-max-attempts", "6", "--policy", "round_robin"],
    ) as stack:  # fmt: skip
        asyncio.run(_scenario(stack))


async def _scenario(stack: LocalStack) -> None:
    victim = next(w for w in stack.workers if w.role is Role.DECODE)
    client = openai.AsyncOpenAI(base_url=f"{stack.router_url}/v1", api_key="none", max_retries=0, timeout=60)
    try:
        async with aiohttp.ClientSession(connector=aiohttp.TCPConnector(limit=0)) as http:
            before = await scrape(stack.router_url)
            tasks = [asyncio.create_task(stream(Route.GENERATE, _body(i), client, http)) for i in range(STREAMS)]
            while not time_to_kill(await scrape(stack.router_url), victim.url, 16, 0):
                assert not all(t.done() for t in tasks), "every stream ended before the victim carried any"
                await asyncio.sleep(0.05)
            victim.proc.signal(signal.SIGKILL)
            outcomes: list[Outcome] = list(await asyncio.gather(*(asyncio.wait_for(t, 90) for t in tasks)))
            after = await scrape(stack.router_url)
    finally:
        await client.close()
    resumed = (after.resumed - before.resumed).total()
    print(f"\ndecode killed under {STREAMS} streams with default numerics: {resumed} resumed")
    assert resumed >= 1, "the kill cut no stream"
    assert [o.error for o in outcomes if not o.ok] == []
    for i, out in enumerate(outcomes):
        assert len(out.ids) == 1, (i, out.ids)
        assert out.output_ids is not None
        output = model.from_ids(out.output_ids)
        assert out.completion_tokens == len(out.output_ids), i
        # the text is exactly the relayed tokens, seam included; the prompt ends in a word, so the output continues
        # it with a separator (``tandem_sim.api.requests.Request.continues_text``, SGLang's incremental detokenizer)
        assert out.text == "".join(f" {word}" for word in output.words), i
        params = model.SamplingParams(max_new_tokens=MAX_TOKENS, temperature=0.0)
        assert off_path(_prompt(_body(i)), output, params) is None, (i, off_path(_prompt(_body(i)), output, params))
