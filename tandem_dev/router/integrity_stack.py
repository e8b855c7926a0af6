"""A router with its integrity checks in front of simulated PD workers, for integrity tests and the bench.

Real processes on loopback: two simulated prefills and one decode per entry of ``race`` (moving KV with
Mooncake), each decode with a small pool of 16-token pages and KV offload on (the configuration of the upstream
offload race; ``--sim-inject-offload-race`` where ``race`` says so), an optional aggregated worker, and
``tandem router`` (round robin, so every pair gets traffic). ``worker_flags`` go to every simulated worker (e.g.
``--enable-deterministic-inference``, as a user would set it on SGLang).
"""

from __future__ import annotations

import sys
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path

import aiohttp

from tandem_dev.procs import ManagedProcess, free_port
from tandem_dev.sim.testing import SimWorker, start_decode, start_prefill, start_worker

# A small decode pool (pages reused constantly) with 16-token pages, so a reused page holds a run of another
# prompt's words long enough for the prompt-leak detector (8 words).
DECODE_POOL = ("--max-total-tokens", "2048", "--page-size", "16")
OFFLOAD = ("--disaggregation-decode-enable-offload-kvcache", "--hicache-storage-backend", "file")
RACE = "--sim-inject-offload-race"


@dataclass
class IntegrityStack:
    prefills: list[SimWorker]
    decodes: list[SimWorker]
    reference: SimWorker | None
    router_url: str


def start_integrity_stack(
    log_dir: Path,
    procs: list[ManagedProcess],
    race: Sequence[bool],
    router_flags: Sequence[str] = (),
    worker_flags: Sequence[str] = (),
    reference: bool = True,
) -> IntegrityStack:
    """Start the stack; every process is appended to ``procs`` as it starts (the caller stops them)."""
    # SGLang's decode refuses (and its scheduler dies on) a prefill with another --page-size
    prefills = []
    for i in range(2):
        prefills.append(start_prefill(f"prefill{i}", log_dir, [*worker_flags, *DECODE_POOL[2:]]))
        procs.append(prefills[-1].proc)
    decodes = []
    for i, garbles in enumerate(race):
        flags = [*DECODE_POOL, *OFFLOAD, *worker_flags] + ([RACE] if garbles else [])
        decodes.append(start_decode(f"decode{i}", log_dir, flags))
        procs.append(decodes[-1].proc)
    aggregated = start_worker("aggregated", log_dir, worker_flags) if reference else None
    if aggregated is not None:
        procs.append(aggregated.proc)
    port = free_port()
    argv = [sys.executable, "-m", "tandem.cli", "router", "--port", str(port), "--policy", "round_robin"]
    for p in prefills:
        argv += ["--prefill", p.url, str(p.bootstrap_port)]
    for d in decodes:
        argv += ["--decode", d.url]
    router = ManagedProcess("router", [*argv, *router_flags], log_dir / "router.log").start()
    procs.append(router)
    router.wait_http(f"http://127.0.0.1:{port}/readiness", timeout=30)
    return IntegrityStack(prefills, decodes, aggregated, f"http://127.0.0.1:{port}")


async def integrity_state(sess: aiohttp.ClientSession, router_url: str) -> dict[str, object]:
    """The router's ``/integrity`` document (quarantined pairs and workers, share, repeat offenders)."""
    async with sess.get(f"{router_url}/integrity") as resp:
        doc: dict[str, object] = await resp.json()
        return doc


async def metric_values(sess: aiohttp.ClientSession, url: str, name: str) -> dict[str, float]:
    """Samples of counter/gauge ``name`` on ``url``/metrics, keyed by their label text (``""`` without labels)."""
    return (await metrics_of(sess, url, [name]))[name]


async def metrics_of(sess: aiohttp.ClientSession, url: str, names: Sequence[str]) -> dict[str, dict[str, float]]:
    """``metric_values`` of each of ``names`` from one scrape of ``url``/metrics."""
    async with sess.get(f"{url}/metrics") as resp:
        text = await resp.text()
    out: dict[str, dict[str, float]] = {name: {} for name in names}
    for line in text.splitlines():
        if line.startswith("#"):
            continue
        head, _, value = line.rpartition(" ")
        metric, _, labels = head.partition("{")
        if metric in out:
            samples = out[metric]
            samples[labels.rstrip("}")] = samples.get(labels.rstrip("}"), 0.0) + float(value)
    return out
