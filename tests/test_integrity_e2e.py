"""Output integrity end to end: the router detects a garbling decode, quarantines its pairs, keeps serving.

Real processes on loopback (inside the suite's loopback-only netns): simulated prefill and decode workers moving
KV with Mooncake, one decode running ``--sim-inject-offload-race`` (the upstream decode KV-offload slot-reuse
races), an aggregated worker as the ground truth, and ``tandem router`` with its integrity checks on.
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import aiohttp
import orjson
import pytest

from tandem_dev.procs import ManagedProcess
from tandem_dev.router.integrity_stack import IntegrityStack, integrity_state, start_integrity_stack
from tandem_dev.sim.testing import SimWorker
from tests.plumbing.simhelpers import bounded, metric_sum, prompts

# These tests compare answers with the aggregated worker's text, so every worker runs batch-invariant kernels, as a
# user who wants that guarantee runs SGLang. Under the default batch-variant numerics: tests/test_integrity_numerics.py.
WORKERS = ["--sim-inter-token-ms", "1", "--enable-deterministic-inference"]
LOAD_AFTER_QUARANTINE_S = 60.0


@dataclass
class Outcome:
    body: dict[str, Any]
    started: float
    ended: float
    status: int
    text: str


def _start_stack(
    tmp_path: Path, procs: list[ManagedProcess], race: Sequence[bool], router_flags: Sequence[str]
) -> IntegrityStack:
    return start_integrity_stack(tmp_path, procs, race, router_flags, WORKERS)


async def _generate(
    sess: aiohttp.ClientSession, url: str, body: dict[str, Any], stream: bool, headers: dict[str, str] | None = None
) -> tuple[int, str]:
    async with sess.post(f"{url}/generate", json={**body, "stream": stream}, headers=headers) as resp:
        if not stream:
            doc = await resp.json()
            return resp.status, doc.get("text", "") if resp.status == 200 else str(doc)
        text = ""
        async for line in resp.content:
            if line.startswith(b"data: {"):
                event = orjson.loads(line[6:])
                text = event.get("text", text)  # /generate streams carry the cumulative text
        return resp.status, text


async def _load(
    sess: aiohttp.ClientSession,
    url: str,
    bodies: list[dict[str, Any]],
    concurrency: int,
    until: asyncio.Event,
    headers: dict[str, str] | None = None,
) -> list[Outcome]:
    """``concurrency`` clients cycling through ``bodies`` until ``until`` is set or every body was sent once."""
    queue = list(enumerate(bodies))
    out: list[Outcome] = []

    async def client() -> None:
        while queue and not until.is_set():
            i, body = queue.pop()
            started = time.monotonic()
            status, text = await _generate(sess, url, body, stream=i % 2 == 0, headers=headers)
            out.append(Outcome(body, started, time.monotonic(), status, text))

    await asyncio.gather(*(client() for _ in range(concurrency)))
    return out


async def _references(sess: aiohttp.ClientSession, reference: SimWorker, bodies: list[dict[str, Any]]) -> list[str]:
    async def one(body: dict[str, Any]) -> str:
        return (await _generate(sess, reference.url, body, stream=False))[1]

    return list(await bounded(32, [one(b) for b in bodies]))


def _reference(stack: IntegrityStack) -> SimWorker:
    assert stack.reference is not None
    return stack.reference


async def _integrity(sess: aiohttp.ClientSession, url: str) -> dict[str, Any]:
    return dict(await integrity_state(sess, url))


@dataclass
class Watch:
    """When the garbling decode's first pair, and then the decode itself, went out of client traffic."""

    first_pair: float | None = None
    worker: float | None = None
    max_share: float = 0.0
    offenders: list[str] = field(default_factory=list)


async def _watch(sess: aiohttp.ClientSession, url: str, bad: str, load_s: float, done: asyncio.Event) -> Watch:
    """Poll ``/integrity`` until ``load_s`` seconds after the decode went out (or 60 s without that)."""
    seen = Watch()
    deadline = time.monotonic() + 60
    while time.monotonic() < deadline:
        doc = await _integrity(sess, url)
        now = time.monotonic()
        seen.max_share = max(seen.max_share, doc["quarantined_share"])
        seen.offenders = [o["worker"] for o in doc["repeat_offenders"]]
        if seen.first_pair is None and any(q["decode"] == bad for q in doc["quarantined"]):
            seen.first_pair = now
        if seen.worker is None and bad in doc["quarantined_workers"]:
            seen.worker = now
            deadline = now + load_s
        await asyncio.sleep(0.1)
    done.set()
    return seen


@pytest.mark.netns
@pytest.mark.slow
@pytest.mark.timeout(400)
async def test_garbling_decode_is_quarantined_and_never_released_into_traffic_with_defaults(
    tmp_path: Path, proc_factory: list[ManagedProcess]
) -> None:
    """Default router settings: one of two decodes runs the offload race under 48 clients (one client identity:
    every request comes from the same loopback peer, so detector findings need a canary or shadow confirmation).
    Its pairs are quarantined within 10 s; over 60 s of further load, probation (mirrored live traffic) keeps
    failing it, so no garbled answer reaches a client after the quarantine, and it is reported as a repeat
    offender."""
    stack = _start_stack(tmp_path, proc_factory, race=[False, True], router_flags=[])
    bad = stack.decodes[1].url
    unique = prompts(1500, seed=11)
    bodies = [unique[i % len(unique)] for i in range(60_000)]
    done = asyncio.Event()
    async with aiohttp.ClientSession(connector=aiohttp.TCPConnector(limit=0)) as sess:
        watcher = asyncio.create_task(_watch(sess, stack.router_url, bad, LOAD_AFTER_QUARANTINE_S, done))
        results = await _load(sess, stack.router_url, bodies, concurrency=48, until=done)
        seen = await watcher
        wanted = dict(
            zip((orjson.dumps(b) for b in unique), await _references(sess, _reference(stack), unique), strict=True)
        )
        doc = await _integrity(sess, stack.router_url)
        quarantines = await metric_sum(stack.router_url, "tandem_integrity_quarantines_total")
        releases = await metric_sum(stack.router_url, "tandem_integrity_releases_total")
        comparisons = await metric_sum(stack.router_url, "tandem_integrity_probation_comparisons_total")

    assert all(r.status == 200 for r in results), [r.text for r in results if r.status != 200][:3]
    garbled = [r for r in results if r.text != wanted[orjson.dumps(r.body)]]
    assert garbled, "the injected offload race produced no garbled output"
    assert seen.first_pair is not None, f"the garbling decode was never quarantined: {doc}"
    assert seen.worker is not None, f"the garbling decode never went out of traffic: {doc}"
    first_garbled = min(r.ended for r in garbled)
    after_pair = [r for r in garbled if r.started > seen.first_pair]
    after_worker = [r for r in garbled if r.started > seen.worker]
    served_after = [r for r in results if r.started > seen.worker]
    print(
        f"\nfirst garbled response -> first pair quarantined {seen.first_pair - first_garbled:.2f} s, decode out "
        f"{seen.worker - first_garbled:.2f} s; garbled before: {len(garbled) - len(after_pair)}; garbled sent after "
        f"the first pair's quarantine: {len(after_pair)}, after the decode's: {len(after_worker)} of "
        f"{len(served_after)} requests over {results[-1].ended - seen.worker:.0f} s; quarantines {quarantines:.0f}, "
        f"releases {releases:.0f}, probation comparisons {comparisons:.0f}, max share out {seen.max_share:.2f}; "
        f"repeat offenders {seen.offenders}"
    )
    assert seen.worker - first_garbled <= 10.0
    assert after_worker == [], [r.text for r in after_worker][:3]
    assert len(served_after) >= 500, f"only {len(served_after)} requests after the quarantine"
    assert max(r.ended for r in results) - seen.worker >= LOAD_AFTER_QUARANTINE_S - 1
    assert {q["decode"] for q in doc["quarantined"]} == {bad}  # the clean pairs kept serving
    assert seen.max_share <= 0.5
    assert bad in seen.offenders


@pytest.mark.netns
@pytest.mark.timeout(600)
async def test_clean_run_of_10000_requests_has_no_false_positive(
    tmp_path: Path, proc_factory: list[ManagedProcess]
) -> None:
    stack = _start_stack(tmp_path, proc_factory, race=[False, False], router_flags=["--canary-interval-s", "2"])
    # Short outputs keep 10,000 requests to about a minute on 2 cores; the prompts still cycle the small decode pool
    # (and its offload) many times over. Each of the 500 distinct bodies is sent 20 times.
    unique = [{**b, "sampling_params": {**b["sampling_params"], "max_new_tokens": 4 + i % 9}} for i, b in
              enumerate(prompts(500, seed=23))]  # fmt: skip
    bodies = [unique[i % len(unique)] for i in range(10_000)]
    async with aiohttp.ClientSession(connector=aiohttp.TCPConnector(limit=0)) as sess:
        started = time.monotonic()
        results = await _load(sess, stack.router_url, bodies, concurrency=64, until=asyncio.Event())
        elapsed = time.monotonic() - started
        print(f"\nclean run: {len(results)} requests in {elapsed:.1f} s ({len(results) / elapsed:.0f} req/s)")
        wanted = dict(
            zip((orjson.dumps(b) for b in unique), await _references(sess, _reference(stack), unique), strict=True)
        )
        doc = await _integrity(sess, stack.router_url)
        detections = await metric_sum(stack.router_url, "tandem_integrity_detections_total")
        checked = await metric_sum(stack.router_url, "tandem_integrity_checked_responses_total")
        canaries = await metric_sum(stack.router_url, "tandem_integrity_canaries_total")
    assert len(results) == 10_000
    assert all(r.status == 200 for r in results)
    garbled = [r for r in results if r.text != wanted[orjson.dumps(r.body)]]
    assert garbled == [], f"{len(garbled)} garbled outputs in a clean run"
    assert detections == 0, doc
    assert doc["quarantined"] == []
    assert checked >= 10_000
    assert canaries > 0


@pytest.mark.netns
@pytest.mark.timeout(240)
async def test_shadow_comparison_finds_the_garbling_decode(tmp_path: Path, proc_factory: list[ManagedProcess]) -> None:
    # Only the shadow comparison can see the garbling here: no canary round runs, and the prompt-leak detector
    # would need 64 words of another prompt.
    flags = ["--shadow-rate", "1", "--leak-ngram-words", "64", "--canary-interval-s", "3600"]
    stack = _start_stack(
        tmp_path, proc_factory, race=[False, True], router_flags=[*flags, "--quarantine-probe-initial-s", "600"]
    )
    bad = stack.decodes[1].url
    bodies = [{**b, "sampling_params": {**b["sampling_params"], "temperature": 0.0}} for b in prompts(3000, seed=5)]
    done = asyncio.Event()
    async with aiohttp.ClientSession(connector=aiohttp.TCPConnector(limit=0)) as sess:

        async def watch() -> None:
            deadline = time.monotonic() + 60
            while time.monotonic() < deadline and not done.is_set():
                doc = await _integrity(sess, stack.router_url)
                if bad in doc["quarantined_workers"]:
                    break
                await asyncio.sleep(0.2)
            done.set()

        watcher = asyncio.create_task(watch())
        await _load(sess, stack.router_url, bodies, concurrency=32, until=done)
        await watcher
        doc = await _integrity(sess, stack.router_url)
    assert await metric_sum(stack.router_url, "tandem_integrity_shadows_total") > 0  # shadows ran
    assert doc["quarantined_workers"] == [bad], doc
    assert any("shadow" in q["reason"] for q in doc["quarantined"]), doc


def _hostile(victims: list[str]) -> list[tuple[str, dict[str, Any]]]:
    """100 requests meant to make the detectors fire: replacement and control characters, special tokens,
    repeated phrases, and other clients' prompts pasted in, over all three routes."""
    chat = "/v1/chat/completions"
    out: list[tuple[str, dict[str, Any]]] = []
    for i in range(100):
        kind = i % 5
        if kind == 0:  # the reproduction
            body = {"messages": [{"role": "user", "content": "please repeat \ufffd \ufffd \ufffd"}], "max_tokens": 8}
            out.append((chat, body))
        elif kind == 1:
            prompt = f"echo \x01\x02\x07 bell \x1b[31m red zero\u200bwidth \ufffd{i}"
            out.append(("/v1/completions", {"prompt": prompt, "max_tokens": 16, "temperature": 0}))
        elif kind == 2:
            text = "repeat forever: " + "river near the old mill " * 30
            out.append(("/generate", {"text": text, "sampling_params": {"max_new_tokens": 40, "temperature": 0}}))
        elif kind == 3:
            text = "repeat exactly: " + victims[i % len(victims)]
            out.append(("/generate", {"text": text, "sampling_params": {"max_new_tokens": 40, "sampling_seed": i}}))
        else:
            content = "say <|im_end|> <|endoftext|> [EOS] </s> then \ufffd\ufffd"
            body = {"messages": [{"role": "user", "content": content}], "max_tokens": 24, "temperature": 0}
            out.append((chat, body))
    for route, body in out:
        if route != "/generate":
            body["model"] = "sim/model"  # the simulated workers' served model name
    return out


@pytest.mark.netns
@pytest.mark.timeout(300)
async def test_hostile_requests_from_one_client_quarantine_nothing(
    tmp_path: Path, proc_factory: list[ManagedProcess]
) -> None:
    """One API key sends 100 hostile requests while 8 other keys send ordinary ones: 0 quarantines, 0 errors for
    the others, and every answer they get is the reference's."""
    keys = ["attacker", *(f"victim-{i}" for i in range(8))]
    stack = _start_stack(tmp_path, proc_factory, race=[False, False], router_flags=[f"--api-key={k}" for k in keys])
    bodies = prompts(400, seed=31)
    hostile = _hostile([b["text"] for b in bodies[:50]])
    done = asyncio.Event()
    hostile_status: list[int] = []
    refused: list[str] = []
    async with aiohttp.ClientSession(connector=aiohttp.TCPConnector(limit=0)) as sess:

        async def attacker() -> None:
            for route, body in hostile:
                async with sess.post(
                    f"{stack.router_url}{route}", json=body, headers={"Authorization": "Bearer attacker"}
                ) as resp:
                    answer = await resp.read()
                    hostile_status.append(resp.status)
                    if resp.status != 200:
                        refused.append(f"{route} {resp.status} {answer[:160]!r}")
            done.set()

        async def victim(key: str, share: list[dict[str, Any]]) -> list[Outcome]:
            return await _load(sess, stack.router_url, share, 1, done, {"Authorization": f"Bearer {key}"})

        outcomes = await asyncio.gather(attacker(), *(victim(k, bodies[i::8]) for i, k in enumerate(keys[1:])))
        results = [r for batch in outcomes[1:] if batch for r in batch]
        wanted = await _references(sess, _reference(stack), [r.body for r in results])
        doc = await _integrity(sess, stack.router_url)
        quarantines = await metric_sum(stack.router_url, "tandem_integrity_quarantines_total")
        findings = await metric_sum(stack.router_url, "tandem_integrity_detections_total")
        held = await metric_sum(stack.router_url, "tandem_integrity_unconfirmed_findings_total")
    statuses = {s: hostile_status.count(s) for s in sorted(set(hostile_status))}
    print(
        f"\nhostile: {len(hostile_status)} requests, statuses {statuses}; detector findings {findings:.0f} "
        f"(held for confirmation {held:.0f}); quarantines {quarantines:.0f}; others: {len(results)} requests"
    )
    assert len(hostile_status) == 100
    assert all(s < 500 for s in hostile_status), sorted(set(refused))[:5]
    assert quarantines == 0, doc
    assert doc["quarantined"] == []
    assert results, "the other clients sent nothing"
    assert [r.status for r in results if r.status != 200] == []
    assert [r.text for r, want in zip(results, wanted, strict=True) if r.text != want] == []
