"""One chaos run in any setting (``tandem chaos``: the local stack in ``tandem_dev.chaos``, the dev cluster in
``tandem_dev.chaos.devcluster``): its knobs, its fault plan, and how it is measured (reference answers, the load
through the routers, the faults one after the other)."""

from __future__ import annotations

import asyncio
import random
import time
from collections.abc import Callable
from dataclasses import dataclass

import aiohttp

from tandem_dev.chaos.faults import KINDS, ChaosTarget, Router
from tandem_dev.chaos.load import LoadSpec, Routers, reference, run_load
from tandem_dev.chaos.report import ChaosReport


@dataclass(frozen=True)
class ChaosArgs:
    streams: int = 100_000
    concurrency: int = 16
    duration_s: float = 60.0
    seed: int = 0
    faults: int = 5
    kinds: tuple[str, ...] = KINDS
    max_tokens: int = 100
    inter_token_ms: float = 10.0
    prompts: int = 16
    hang_s: float = 30.0
    cap_s: float = 60.0
    setting: str = "local"

    def knobs(self) -> dict[str, object]:
        return {
            "setting": self.setting, "streams": self.streams, "concurrency": self.concurrency,
            "duration_s": self.duration_s, "seed": self.seed, "faults": self.faults, "kinds": ",".join(self.kinds),
            "max_tokens": self.max_tokens,
            "sim_inter_token_ms": self.inter_token_ms, "prompts": self.prompts, "hang_s": self.hang_s,
        }  # fmt: skip


def say(message: str) -> None:
    print(f"[{time.strftime('%H:%M:%S')}] {message}", flush=True)


def plan(args: ChaosArgs) -> list[tuple[float, str]]:
    """When (seconds into the load) and what to inject: kinds in a seeded order, every kind before a repeat,
    spread over the first 75% of the run so each fault has load on both sides."""
    rng = random.Random(args.seed)
    kinds: list[str] = []
    while len(kinds) < args.faults:
        batch = list(args.kinds)
        rng.shuffle(batch)
        kinds += batch
    times = sorted(rng.uniform(0.1, 0.75) * args.duration_s for _ in range(args.faults))
    return list(zip(times, kinds[: args.faults], strict=True))


async def measure(
    args: ChaosArgs,
    setting: str,
    model: str,
    routers: list[Router],
    target: Callable[[aiohttp.ClientSession], ChaosTarget],
) -> ChaosReport:
    """Take the reference answers, then run the load (``model``'s chat completions) through ``routers`` while
    ``target`` injects the planned faults one after the other; judge it all. ``target`` gets the run's pooled HTTP
    session."""
    spec = LoadSpec(model, args.prompts, args.max_tokens, args.concurrency, args.streams, args.duration_s,
                    args.hang_s, args.seed)  # fmt: skip
    report = ChaosReport(setting, args.knobs())
    clients = Routers([r.url for r in routers])
    rng = random.Random(args.seed ^ 0xC4A05)
    try:
        async with aiohttp.ClientSession() as http:
            faults = target(http)
            say(f"taking the {args.prompts} reference answers ...")
            sem = asyncio.Semaphore(args.concurrency)

            async def ref(prompt: int) -> str:
                async with sem:
                    return await reference(clients, spec, prompt)

            answers = await asyncio.gather(*(ref(i) for i in range(args.prompts)))
            report.references = dict(enumerate(answers))
            say(f"load: {args.concurrency} streams at a time for {args.duration_s:g} s; faults: {plan(args)}")
            t0 = time.monotonic()
            stop_load = asyncio.Event()
            load = asyncio.create_task(run_load(clients, spec, t0, stop_load))
            for at, kind in plan(args):
                await asyncio.sleep(max(0.0, t0 + at - time.monotonic()))
                if load.done():
                    break
                victim = rng.choice(await faults.victims_now(kind))
                say(f"fault: {kind} {victim}")
                record = await faults.inject(kind, victim, t0)
                report.faults.append(record)
                say(f"  fenced {record.fenced} s, recovered {record.recovered} s ({record.note})")
            report.results = await load
            report.seconds = time.monotonic() - t0
            await faults.scrape_all()
            report.router_counters = faults.counters()
    finally:
        await clients.close()
    return report
