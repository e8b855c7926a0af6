"""``tandem bench prefix``: prefix-cache-aware routing on a multi-turn chat workload, three policies in one run.

Four simulated prefills and two decodes (real PD protocol, real Mooncake KV transfer, the simulator's radix cache
and batching, timed by the ``kimi-k2.6-h200`` profile) serve the same deterministic workload three times: through
Tandem's router with ``--policy cache_aware`` (its default), through SGLang's gateway ``smg`` with
``--policy cache_aware`` (its defaults otherwise) and through Tandem's router with ``--policy round_robin``. Every
prefill's radix cache is flushed before each policy's turn.

The workload: users, each under one of ``SYSTEM_PROMPTS`` shared system prompts, hold conversations of a few
turns; every turn resends the whole history (system prompt, earlier questions and answers) plus a new question,
streams the answer, and the user thinks a while before the next turn. Every ``DOCUMENT_EVERY``-th user pastes a
long document into its first question (prompts of very different sizes, as in document chat). Users start
spread over the first seconds. The prefix-cache hit rate is the simulators' own: ``sglang:cached_tokens_total`` over
``sglang:prompt_tokens_total`` on the prefills (tokens served from the radix cache over prompt tokens), not the
router's guess. TTFT is measured by the client, at the first streamed chunk.
"""

from __future__ import annotations

import asyncio
import random
import sys
import tempfile
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from pathlib import Path

import aiohttp
from prometheus_client.parser import text_string_to_metric_families

from tandem_dev import peers
from tandem_dev.bench import NOT_MEASURED, BenchArgs, Plot, Table
from tandem_dev.procs import ManagedProcess, ProcessFailedError, free_port
from tandem_dev.router.bench_e2e import stream_ttft

HOST = "127.0.0.1"
MODEL = "tandem/sim-model"
PREFILLS, DECODES = 4, 2
SYSTEM_PROMPTS = 2
SYSTEM_WORDS, QUESTION_WORDS, ANSWER_WORDS = 600, 80, 80
DOCUMENT_WORDS, DOCUMENT_EVERY = 2000, 6  # every 6th user pastes a long document into its first question
OUTPUT_TOKENS = 8
PROFILE = "kimi-k2.6-h200"
TIME_FACTOR = 4  # simulated GPU time x4 (as ``tandem bench sim-load``): Python's own CPU time on 2 cores stays small
SEED = 20261201
PERCENTILES = (0, 10, 25, 50, 75, 90, 95, 99, 100)
COLUMNS = ("policy", "requests", "errors", "cache hit rate", "prefill tokens computed", "busiest prefill's share",
           "TTFT p50 ms", "TTFT p99 ms", "p99 vs smg")  # fmt: skip


@dataclass(frozen=True)
class Conversation:
    start_s: float  # when the user sends the first turn, from the start of the run
    system: str
    questions: tuple[str, ...]
    answers: tuple[str, ...]  # the assistant's turns as the history resends them (fixed: same for every policy)
    think_s: tuple[float, ...]  # pause after each answer


def _words(rng: random.Random, n: int) -> str:
    return " ".join("".join(rng.choice("bcdfghklmnprstvz") + rng.choice("aeiou") for _ in range(3)) for _ in range(n))


def workload(users: int, turns: int, seed: int = SEED) -> list[Conversation]:
    """The deterministic conversations of one run."""
    rng = random.Random(seed)
    systems = [f"system prompt {s}: " + _words(rng, SYSTEM_WORDS) for s in range(SYSTEM_PROMPTS)]
    return [
        Conversation(
            start_s=rng.uniform(0, 3.0),
            system=systems[u % SYSTEM_PROMPTS],
            questions=tuple(
                f"user {u} turn {t}: "
                + _words(rng, QUESTION_WORDS + (DOCUMENT_WORDS if t == 0 and u % DOCUMENT_EVERY == 0 else 0))
                for t in range(turns)
            ),
            answers=tuple(_words(rng, ANSWER_WORDS) for _ in range(turns)),
            think_s=tuple(rng.uniform(0.2, 1.0) for _ in range(turns)),
        )
        for u in range(users)
    ]


def messages(conv: Conversation, turn: int) -> list[dict[str, str]]:
    """The chat history a client sends for ``turn`` (0-based) of ``conv``."""
    out = [{"role": "system", "content": conv.system}]
    for t in range(turn):
        out += [{"role": "user", "content": conv.questions[t]}, {"role": "assistant", "content": conv.answers[t]}]
    return [*out, {"role": "user", "content": conv.questions[turn]}]


@dataclass
class Outcome:
    ttft_ms: list[float]
    errors: int = 0
    prompt_tokens: float = 0.0
    cached_tokens: float = 0.0
    computed: list[float] = field(default_factory=list)  # prompt tokens each prefill computed (not cached)

    def pct(self, q: float) -> float:
        s = sorted(self.ttft_ms)
        return s[min(len(s) - 1, int(len(s) * q / 100))] if s else float("nan")

    @property
    def hit_rate(self) -> float:
        return self.cached_tokens / self.prompt_tokens if self.prompt_tokens else float("nan")


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


def _run_policies(
    workdir: Path, conversations: list[Conversation], allow_missing_peers: bool
) -> tuple[dict[str, Outcome | None], list[str]]:
    procs: list[ManagedProcess] = []
    results: dict[str, Outcome | None] = {}
    notes: list[str] = []
    py = sys.executable
    sim = [py, "-m", "tandem.cli", "sim", "--model-path", MODEL, "--host", HOST, "--sim-profile", PROFILE,
           "--sim-time-factor", str(TIME_FACTOR), "--enable-metrics"]  # fmt: skip
    try:
        prefills: list[tuple[str, int]] = []
        for n in range(PREFILLS):
            port, bootstrap = free_port(), free_port()
            argv = [*sim, "--port", str(port), "--disaggregation-mode", "prefill",
                    "--disaggregation-bootstrap-port", str(bootstrap)]  # fmt: skip
            procs.append(ManagedProcess(f"sim-prefill-{n}", argv, workdir / f"sim-prefill-{n}.log").start())
            prefills.append((f"http://{HOST}:{port}", bootstrap))
        decodes = []
        for n in range(DECODES):
            port = free_port()
            argv = [*sim, "--port", str(port), "--disaggregation-mode", "decode"]
            procs.append(ManagedProcess(f"sim-decode-{n}", argv, workdir / f"sim-decode-{n}.log").start())
            decodes.append(f"http://{HOST}:{port}")
        for proc, url in zip(procs, [u for u, _ in prefills] + decodes, strict=True):
            proc.wait_http(f"{url}/health", timeout=120)
        for policy in _policies(prefills, decodes):
            port = free_port()
            try:
                router = ManagedProcess(policy.name.split()[0], policy.argv(port), workdir / f"{port}.log").start()
            except peers.PeerMissingError as err:
                if not allow_missing_peers:
                    raise
                results[policy.name] = None
                notes.append(f"{policy.name} not measured: {str(err).splitlines()[0]}")
                continue
            try:
                router.wait_http(f"http://{HOST}:{port}{policy.ready_path}", timeout=60)
                with asyncio.Runner() as runner:
                    results[policy.name] = runner.run(
                        _measured(f"http://{HOST}:{port}", [u for u, _ in prefills], conversations)
                    )
            except ProcessFailedError as err:
                if not allow_missing_peers or not policy.name.startswith("smg"):
                    raise
                results[policy.name] = None
                notes.append(f"{policy.name} not measured: {str(err).splitlines()[0]}")
            finally:
                router.stop()
    finally:
        for proc in reversed(procs):
            proc.stop()
    return results, notes


def run(args: BenchArgs) -> list[Table]:
    users, turns = (12, 3) if args.quick else (40, 5)
    if not args.allow_missing_peers:
        peers.require("smg")  # fail before starting anything
    conversations = workload(users, turns)
    with tempfile.TemporaryDirectory(prefix="tandem-bench-prefix-") as tmp:
        results, notes = _run_policies(Path(tmp), conversations, args.allow_missing_peers)
    return [summary(results, users, turns, notes), distribution(results)]


def summary(results: dict[str, Outcome | None], users: int, turns: int, notes: list[str]) -> Table:
    smg = next((r for name, r in results.items() if name.startswith("smg")), None)
    table = Table(
        f"prefix-cache-aware routing: {users} users x {turns} turns of multi-turn chat ({SYSTEM_PROMPTS} shared "
        f"system prompts), {PREFILLS} prefills + {DECODES} decodes, sim profile {PROFILE} x{TIME_FACTOR} slower",
        COLUMNS,
    )
    for name, r in results.items():
        if r is None:
            table.rows.append([name, *[NOT_MEASURED] * (len(table.columns) - 1)])
            continue
        table.rows.append([
            name, len(r.ttft_ms), r.errors, f"{r.hit_rate:.1%}", int(r.prompt_tokens - r.cached_tokens),
            f"{max(r.computed) / max(sum(r.computed), 1):.0%}", r.pct(50), r.pct(99),
            f"{r.pct(99) / smg.pct(99):.2f}x" if smg else NOT_MEASURED,
        ])  # fmt: skip
    table.notes += notes
    table.notes.append(
        "cache hit rate: the prefills' own sglang:cached_tokens_total / sglang:prompt_tokens_total over the run; "
        "Tandem's integrity checks (default on) add their canary and shadow requests to it"
    )
    table.notes.append(
        f"busiest prefill's share: of the prompt tokens computed, the share of the prefill that computed most "
        f"(1/{PREFILLS} is an even spread)"
    )
    table.notes.append(
        f"each turn resends the history: {SYSTEM_WORDS}-word system prompt + {QUESTION_WORDS}-word questions and "
        f"{ANSWER_WORDS}-word answers, every {DOCUMENT_EVERY}th user's first question with a {DOCUMENT_WORDS}-word "
        f"document; {OUTPUT_TOKENS} output tokens; seed {SEED}; all processes share this machine"
    )
    return table


def distribution(results: dict[str, Outcome | None]) -> Table:
    measured = {name: r for name, r in results.items() if r is not None}
    return Table(
        "TTFT distribution per policy (ms at each percentile: the CDF with its axes swapped)",
        ["percentile", *measured],
        rows=[[q, *(r.pct(q) for r in measured.values())] for q in PERCENTILES],
        plot=Plot("line", "percentile", list(measured), "TTFT ms", log_y=True),
    )
