"""Fabric locality end to end: etcd, 2 prefill + 2 decode ``tandem sim`` workers whose registry entries carry their
RDMA fabric domain (as the operator writes them from the leader's node label), and ``tandem router`` (its default
``--fabric-locality auto``: the mode the entries carry).

prefill-0 and decode-0 share rack-a; prefill-1 is alone in rack-b, decode-1 in rack-c. Preferred: every request
takes the one same-domain pair while it is there, a cross-domain pair once it is gone. Required (the entries
re-put with ``fabric_mode: required``): with no same-domain pair every request is an OpenAI 503, counted; back
to the same-domain pair once decode-0 is registered again.
"""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path
from typing import Any

import aiohttp
import pytest
from prometheus_client.parser import text_string_to_metric_families

from tandem import registry
from tandem.leased_writer import LeasedWriter
from tandem.registry import FabricMode
from tandem_dev.local_stack import CLUSTER, MODEL, NAMESPACE, LocalStack, Worker
from tandem_dev.stack_fixture import running_stack
from tests.tandem_dev.devcluster.devcluster_fixtures import eventually

pytestmark = [pytest.mark.netns, pytest.mark.timeout(300)]

DOMAINS = {"prefill-0": "rack-a", "decode-0": "rack-a", "prefill-1": "rack-b", "decode-1": "rack-c"}
CHAT_ROUTE = "/v1/chat/completions"


@pytest.fixture(scope="module")
def stack(tmp_path_factory: pytest.TempPathFactory) -> Iterator[LocalStack]:
    workdir: Path = tmp_path_factory.mktemp("fabric")
    options: dict[str, Any] = {"fabric_domains": DOMAINS, "fabric_mode": FabricMode.PREFERRED}
    # No integrity checks: their canaries go through every pair the mode forms, and the test counts each worker's
    # requests (tests/router/test_fabric.py checks that required mode forms no cross-domain pair for them).
    router_args = ("--no-integrity",)
    with running_stack(workdir, router_port=0, secure=False, router_args=router_args, **options) as s:
        yield s


def _worker(stack: LocalStack, group: str) -> Worker:
    return next(w for w in stack.workers if w.group == group)


async def _chat(http: aiohttp.ClientSession, stack: LocalStack, i: int) -> tuple[int, dict[str, Any]]:
    body = {"model": MODEL, "messages": [{"role": "user", "content": f"{i}: where is my KV?"}], "max_tokens": 4}
    async with http.post(f"{stack.router_url}{CHAT_ROUTE}", json=body) as resp:
        return resp.status, await resp.json()


async def _samples(http: aiohttp.ClientSession, url: str) -> dict[tuple[str, tuple[tuple[str, str], ...]], float]:
    async with http.get(f"{url}/metrics") as resp:
        text = await resp.text()
    return {
        (s.name, tuple(sorted(s.labels.items()))): s.value
        for family in text_string_to_metric_families(text)
        for s in family.samples
    }


async def _choices(http: aiohttp.ClientSession, stack: LocalStack) -> dict[str, float]:
    samples = await _samples(http, stack.router_url)
    return {
        where: samples.get(("tandem_router_fabric_pair_choices_total", (("locality", where),)), 0.0)
        for where in ("same", "cross", "unknown")
    }


async def _served(http: aiohttp.ClientSession, worker: Worker) -> float:
    """Requests the worker finished (SGLang's counter, from the simulator's /metrics)."""
    samples = await _samples(http, worker.url)
    return sum(v for (name, _), v in samples.items() if name == "sglang:num_requests_total")


async def test_pairs_stay_in_one_fabric_domain_preferred_then_required(stack: LocalStack) -> None:
    d0, d1 = _worker(stack, "decode-0"), _worker(stack, "decode-1")
    writer = LeasedWriter(stack.etcd_endpoints, ttl=30)
    await writer.start()
    try:
        async with aiohttp.ClientSession(timeout=aiohttp.ClientTimeout(total=60)) as http:
            # Preferred, every worker up: only prefill-0 -> decode-0 (rack-a) serves.
            for i in range(6):
                assert (await _chat(http, stack, i))[0] == 200
            assert await _choices(http, stack) == {"same": 6, "cross": 0, "unknown": 0}
            assert (await _served(http, d0), await _served(http, d1)) == (6, 0)

            # decode-0 unregistered: no same-domain pair is left, so preferred crosses domains.
            await writer.delete(registry.endpoint_key(NAMESPACE, CLUSTER, d0.endpoint(MODEL)))

            async def d0_gone() -> bool:
                samples = await _samples(http, stack.router_url)
                return not any(dict(labels).get("worker") == d0.url for _, labels in samples)

            await eventually(d0_gone, "the router dropping decode-0", within=30)
            for i in range(6, 10):
                assert (await _chat(http, stack, i))[0] == 200
            choices = await _choices(http, stack)
            assert choices["same"] == 6
            assert choices["cross"] >= 4
            assert await _served(http, d1) == 4

            # The entries now say required (PDCluster spec.fabric.mode: Required): the same pairs are refused.
            for w in stack.workers:
                if w is not d0:
                    entry = w.endpoint(MODEL).model_copy(update={"fabric_mode": FabricMode.REQUIRED})
                    await writer.put(registry.endpoint_key(NAMESPACE, CLUSTER, entry), registry.encode(entry))

            async def refused() -> dict[str, Any] | None:
                status, body = await _chat(http, stack, 100)
                return body["error"] if status == 503 else None

            error = await eventually(refused, "a 503 for want of a same-domain pair", within=30)
            assert error["code"] == "no_fabric_local_pair"
            assert error["type"] == "service_unavailable"
            assert "fabric" in error["message"]
            before, d1_served = await _choices(http, stack), await _served(http, d1)  # (polls before it: served)
            for i in range(3):
                status, body = await _chat(http, stack, 200 + i)
                assert (status, body["error"]["code"]) == (503, "no_fabric_local_pair")
            assert await _choices(http, stack) == before  # nothing was chosen
            samples = await _samples(http, stack.router_url)
            refusals = ("tandem_router_fabric_refused_requests_total", (("route", CHAT_ROUTE),))
            assert samples[refusals] >= 4
            async with http.get(f"{stack.router_url}/readiness") as resp:
                assert resp.status == 503
            assert await _served(http, d1) == d1_served

            # decode-0 back in rack-a: the same-domain pair serves again, still never decode-1.
            entry = d0.endpoint(MODEL).model_copy(update={"fabric_mode": FabricMode.REQUIRED})
            await writer.put(registry.endpoint_key(NAMESPACE, CLUSTER, entry), registry.encode(entry))

            async def serves() -> bool:
                return (await _chat(http, stack, 300))[0] == 200

            await eventually(serves, "decode-0 serving again", within=30)
            for i in range(4):
                assert (await _chat(http, stack, 400 + i))[0] == 200
            after = await _choices(http, stack)
            assert after["cross"] == before["cross"]
            assert after["same"] >= before["same"] + 5
            assert await _served(http, d1) == d1_served
    finally:
        await writer.close(revoke=True)
