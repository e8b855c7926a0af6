"""``tandem bench prefix``: prefix-cache-aware routing on multi-turn chat, three policies interleaved, on workloads
the router's defaults were not tuned on, several seeds each.

Four simulated prefills and two decodes (real PD protocol, real Mooncake KV transfer, the simulator's radix cache
and batching, timed by the ``kimi-k2.6-h200`` profile) serve the same deterministic workload through three
policies: Tandem's router with ``--policy cache_aware`` (its default), SGLang's gateway ``smg`` with
``--policy cache_aware`` (its defaults otherwise) and Tandem's router with ``--policy round_robin``.

Why this design (issue #41 item 6): ``--balance-abs-threshold``'s default was tuned with this bench on one
workload and seed (tandem_dev.router.prefix_workload.TUNING, SEED), so the reported comparison runs on held-out
workloads (``HELD_OUT``) and seeds (``HELD_OUT_SEEDS``) instead; the tuning workload runs once more as a labelled
reference. One round is one workload and seed, the three policies one after another in an order rotated from
round to round, so that no policy always runs first or last (a change in the shared machine's load falls on every
policy alike); each policy's run starts its router fresh on prefills whose radix caches were just flushed. The
tables report per policy the median over seeds with the min-max (tandem_dev.router.prefix_report).

The prefix-cache hit rate is the simulators' own: ``sglang:cached_tokens_total`` over
``sglang:prompt_tokens_total`` on the prefills (tokens served from the radix cache over prompt tokens), not the
router's guess. TTFT is measured by the client, at the first streamed chunk.
"""

from __future__ import annotations

import asyncio
import sys
import tempfile
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from pathlib import Path

import aiohttp
from prometheus_client.parser import text_string_to_metric_families

from tandem_dev import peers
from tandem_dev.bench import BenchArgs, Table
from tandem_dev.procs import ManagedProcess, ProcessFailedError, free_port
from tandem_dev.router.bench_e2e import stream_ttft
from tandem_dev.router.prefix_report import Outcome, Run, distribution, per_run, summary
from tandem_dev.router.prefix_workload import (
    HELD_OUT,
    HELD_OUT_SEEDS,
    SEED,
    TUNING,
    Conversation,
    Shape,
    messages,
    workload,
)

HOST = "127.0.0.1"
MODEL = "tandem/sim-model"
PREFILLS, DECODES = 4, 2
OUTPUT_TOKENS = 8
PROFILE = "kimi-k2.6-h200"
TIME_FACTOR = 4  # simulated GPU time x4 (as ``tandem bench sim-load``): Python's own CPU time on 2 cores stays small
QUICK_USERS, QUICK_TURNS, QUICK_SEEDS = 12, 3, 2  # --quick: the first held-out shape only, smaller, 2 seeds
REFERENCE = f"tuning (reference, seed {SEED})"


def chat_body(msgs: list[dict[str, str]], model: str = MODEL) -> dict[str, object]:
    return {"model": model, "messages": msgs, "max_tokens": OUTPUT_TOKENS, "temperature": 0, "stream": True}


async def drive(url: str, conversations: Sequence[Conversation]) -> Outcome:
    """Every conversation at once, each turn after the previous answer and the user's pause."""
    out = Outcome([])
    started = time.monotonic()

    async def user(http: aiohttp.ClientSession, conv: Conversation) -> None:
        await asyncio.sleep(max(0.0, conv.start_s - (time.monotonic() - started)))
        for turn in range(len(conv.questions)):
            try:
                body = chat_body(messages(conv, turn))
                out.ttft_ms.append(await stream_ttft(http, f"{url}/v1/chat/completions", body))
            except (TimeoutError, RuntimeError, aiohttp.ClientError):
                out.errors += 1
            await asyncio.sleep(conv.think_s[turn])

    timeout = aiohttp.ClientTimeout(total=120)
    async with aiohttp.ClientSession(connector=aiohttp.TCPConnector(limit=0), timeout=timeout) as http:
        await asyncio.gather(*(user(http, c) for c in conversations))
    return out


async def prefill_counters(http: aiohttp.ClientSession, prefills: Sequence[str]) -> list[tuple[float, float]]:
    """Prompt tokens and radix-cache tokens of each prefill, from its own ``/metrics``."""
    out = []
    for url in prefills:
        async with http.get(f"{url}/metrics") as resp:
            text = await resp.text()
        prompt = cached = 0.0
        for family in text_string_to_metric_families(text):
            for sample in family.samples:
                if sample.name == "sglang:prompt_tokens_total":
                    prompt += sample.value
                elif sample.name == "sglang:cached_tokens_total":
                    cached += sample.value
        out.append((prompt, cached))
    return out


async def _warm_up(http: aiohttp.ClientSession, url: str, timeout_s: float = 60.0) -> None:
    """One request served end to end (smg answers /health before it has probed its workers)."""
    deadline = time.monotonic() + timeout_s
    while True:
        try:
            body = chat_body([{"role": "user", "content": "warm up the connections"}])
            await stream_ttft(http, f"{url}/v1/chat/completions", body)
            return
        except RuntimeError:
            if time.monotonic() > deadline:
                raise
            await asyncio.sleep(0.5)


async def _measured(url: str, prefills: Sequence[str], conversations: Sequence[Conversation]) -> Outcome:
    async with aiohttp.ClientSession() as http:
        await _warm_up(http, url)
        for p in prefills:  # an empty radix cache for every policy (the simulator refuses while busy: retry)
            for _ in range(50):
                async with http.post(f"{p}/flush_cache") as resp:
                    if resp.status == 200:
                        break
                await asyncio.sleep(0.1)
        before = await prefill_counters(http, prefills)
        out = await drive(url, conversations)
        after = await prefill_counters(http, prefills)
    prompt = [a[0] - b[0] for a, b in zip(after, before, strict=True)]
    cached = [a[1] - b[1] for a, b in zip(after, before, strict=True)]
    out.prompt_tokens, out.cached_tokens = sum(prompt), sum(cached)
    out.computed = [p - c for p, c in zip(prompt, cached, strict=True)]
    return out


@dataclass(frozen=True)
class Policy:
    name: str
    argv: Callable[[int], list[str]]  # port -> the router's command line
    ready_path: str


def _policies(prefills: list[tuple[str, int]], decodes: list[str]) -> list[Policy]:
    py = sys.executable
    tandem = [py, "-m", "tandem.cli", "router", "--log-level", "warning"]
    for url, bootstrap in prefills:
        tandem += ["--prefill", url, str(bootstrap)]
    for url in decodes:
        tandem += ["--decode", url]
    smg_metrics = free_port()
    return [
        Policy("tandem cache_aware", lambda port: [*tandem, "--port", str(port)], "/readiness"),
        Policy(
            f"smg {peers.smg_version()} cache_aware",
            lambda port: peers.smg_argv(prefills, decodes, port, smg_metrics, policy="cache_aware"),
            "/health",
        ),
        Policy("tandem round_robin", lambda port: [*tandem, "--port", str(port), "--policy=round_robin"], "/readiness"),
    ]


@dataclass(frozen=True)
class Round:
    label: str  # the workload's row label
    shape: Shape
    seed: int
    rotation: int  # the policies' order: the list rotated left by this many


def rounds(quick: bool) -> list[Round]:
    """Seed after seed, every held-out shape for each; the rotation steps with the seed and the shape, so over
    3 seeds each policy runs first, middle and last once on every shape. The tuning reference comes last."""
    shapes, seeds = (HELD_OUT[:1], HELD_OUT_SEEDS[:QUICK_SEEDS]) if quick else (HELD_OUT, HELD_OUT_SEEDS)
    out = [Round(s.name, s, seed, i + k) for i, seed in enumerate(seeds) for k, s in enumerate(shapes)]
    return out if quick else [*out, Round(REFERENCE, TUNING, SEED, 0)]


def sizes(shape: Shape, quick: bool) -> tuple[int, int]:
    """Users and turns of one run."""
    return (QUICK_USERS, QUICK_TURNS) if quick else (shape.users, shape.turns)


class _Fleet:
    """The simulated prefills and decodes, started once for every round."""

    def __init__(self, workdir: Path) -> None:
        self.procs: list[ManagedProcess] = []
        self.prefills: list[tuple[str, int]] = []
        self.decodes: list[str] = []
        sim = [sys.executable, "-m", "tandem.cli", "sim", "--model-path", MODEL, "--host", HOST, "--sim-profile",
               PROFILE, "--sim-time-factor", str(TIME_FACTOR), "--enable-metrics"]  # fmt: skip
        for n in range(PREFILLS):
            port, bootstrap = free_port(), free_port()
            argv = [*sim, "--port", str(port), "--disaggregation-mode", "prefill",
                    "--disaggregation-bootstrap-port", str(bootstrap)]  # fmt: skip
            self.procs.append(ManagedProcess(f"sim-prefill-{n}", argv, workdir / f"sim-prefill-{n}.log").start())
            self.prefills.append((f"http://{HOST}:{port}", bootstrap))
        for n in range(DECODES):
            port = free_port()
            argv = [*sim, "--port", str(port), "--disaggregation-mode", "decode"]
            self.procs.append(ManagedProcess(f"sim-decode-{n}", argv, workdir / f"sim-decode-{n}.log").start())
            self.decodes.append(f"http://{HOST}:{port}")
        for proc, url in zip(self.procs, [u for u, _ in self.prefills] + self.decodes, strict=True):
            proc.wait_http(f"{url}/health", timeout=120)

    def stop(self) -> None:
        for proc in reversed(self.procs):
            proc.stop()


def _run_one(
    fleet: _Fleet, policy: Policy, conversations: list[Conversation], workdir: Path, allow_missing_peers: bool
) -> Outcome | str:
    """One policy's run on a fresh router; the reason it was not measured, where a peer is allowed to miss."""
    port = free_port()
    try:
        router = ManagedProcess(policy.name.split()[0], policy.argv(port), workdir / f"{port}.log").start()
    except peers.PeerMissingError as err:
        if not allow_missing_peers:
            raise
        return str(err).splitlines()[0]
    try:
        router.wait_http(f"http://{HOST}:{port}{policy.ready_path}", timeout=60)
        with asyncio.Runner() as runner:
            return runner.run(_measured(f"http://{HOST}:{port}", [u for u, _ in fleet.prefills], conversations))
    except ProcessFailedError as err:
        if not allow_missing_peers or not policy.name.startswith("smg"):
            raise
        return str(err).splitlines()[0]
    finally:
        router.stop()


def _run_rounds(
    workdir: Path, plan: Sequence[Round], quick: bool, allow_missing_peers: bool
) -> tuple[list[Run], list[str]]:
    runs: list[Run] = []
    missing: dict[str, str] = {}  # policy -> why it is not measured (not tried again)
    fleet = _Fleet(workdir)
    try:
        policies = _policies(fleet.prefills, fleet.decodes)
        for rnd in plan:
            conversations = workload(*sizes(rnd.shape, quick), seed=rnd.seed, shape=rnd.shape)
            k = rnd.rotation % len(policies)
            for order, policy in enumerate([*policies[k:], *policies[:k]], start=1):
                started = time.monotonic()
                got = missing.get(policy.name) or _run_one(fleet, policy, conversations, workdir, allow_missing_peers)
                if isinstance(got, str):
                    missing[policy.name] = got
                runs.append(Run(rnd.label, rnd.seed, order, policy.name, got if isinstance(got, Outcome) else None))
                print(f"# prefix: {rnd.label} seed {rnd.seed} #{order} {policy.name}: "
                      f"{time.monotonic() - started:.0f}s", file=sys.stderr, flush=True)  # fmt: skip
    finally:
        fleet.stop()
    return runs, [f"{name} not measured: {why}" for name, why in missing.items()]


def run(args: BenchArgs) -> list[Table]:
    if not args.allow_missing_peers:
        peers.require("smg")  # fail before starting anything
    plan = rounds(args.quick)
    with tempfile.TemporaryDirectory(prefix="tandem-bench-prefix-") as tmp:
        runs, notes = _run_rounds(Path(tmp), plan, args.quick, args.allow_missing_peers)
    held_out = [r for r in runs if r.workload != REFERENCE]
    seeds = sorted({r.seed for r in held_out})
    title = (
        f"prefix-cache-aware routing on held-out multi-turn chat workloads: median (min-max) over seeds "
        f"{', '.join(map(str, seeds))}, policies interleaved, {PREFILLS} prefills + {DECODES} decodes, sim profile "
        f"{PROFILE} x{TIME_FACTOR} slower"
    )
    shapes = {rnd.label: rnd.shape for rnd in plan}
    notes += [
        f"{label}: {users} users x {turns} turns, {shape.describe()}"
        for label, shape in shapes.items()
        for users, turns in [sizes(shape, args.quick)]
    ]
    notes += [
        f"--balance-abs-threshold's default (4096) was tuned on the tuning workload with seed {SEED}; the held-out "
        "workloads and seeds were not used to tune any default"
        + ("" if args.quick else f"; '{REFERENCE}' is that tuned-on run, for reference"),
        "one round = one workload and seed: the policies one after another in an order rotated per round "
        "('order in round' in the per-run table), each on a fresh router and prefills whose radix caches were "
        "just flushed",
        "p99 vs smg: computed per seed (the same conversations), then the median (min-max) of those ratios",
        "cache hit rate: the prefills' own sglang:cached_tokens_total / sglang:prompt_tokens_total over the run; "
        "Tandem's integrity checks (default on) add their canary and shadow requests to it",
        f"busiest prefill's share: of the prompt tokens computed, the share of the prefill that computed most "
        f"(1/{PREFILLS} is an even spread); {OUTPUT_TOKENS} output tokens; all processes share this machine",
    ]
    return [summary(title, runs, notes), distribution(held_out, "held-out workloads"), per_run(runs)]
