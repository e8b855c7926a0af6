"""``tandem chaos``: a bounded chaos run on the local stack (or, ``--setting dev-cluster``, on the dev cluster with
the operator: ``tandem_dev.chaos.devcluster``), with its results saved and printed.

The local stack: a 3-member etcd, 2 prefill + 2 decode simulated SGLang workers (real PD protocol, real Mooncake KV
transfer over TCP, restarted by the stack's supervisor when they die) and 2 routers. Clients run temperature-0
chat streams (``--concurrency`` at a time, at most ``--streams``, for ``--duration`` seconds) over a fixed set of
prompts whose uninterrupted answers were taken first. Meanwhile ``--faults`` faults, drawn from ``--seed``, hit
one process each (``tandem_dev.chaos.faults``), one after the other. Every stream is judged against its reference
(``tandem_dev.chaos.report``): lost before its first byte, broken after it (error event or cut), hung, garbled;
a stream lost or cut on a router killed while it was in flight is counted apart, the one exemption.
Text equality with the reference holds only with batch-invariant kernels: the workers run
``--enable-deterministic-inference`` (the dev-cluster setting: ``spec.deterministicInference``).

The run stops by itself: the load ends after ``--duration``, each fault's measurement after ``--cap-s``, a silent
stream after ``--hang-s``. It binds loopback only and must run inside a loopback-only network namespace
(``make chaos`` uses ``scripts/in-netns.sh``): Mooncake listens on every interface. It stops only the processes
it started, by process group. Results: ``build/chaos/<UTC time>/`` (``results.json`` with the tables, the git
commit and the machine; ``timeline.png``, ``recovery.png``); the exit code is 1 when an invariant broke
(a stream not equal to its reference, unless cut on its killed router; a fault not recovered).
"""

from __future__ import annotations

import argparse
import asyncio
import re
import sys
import tempfile
import time
from collections.abc import Sequence
from pathlib import Path

from tandem.registry import Role
from tandem_dev.bench.results import Results
from tandem_dev.chaos.faults import KINDS, ChaosTarget, LocalCluster, Router
from tandem_dev.chaos.plots import plot_recovery, plot_timeline
from tandem_dev.chaos.report import ChaosReport, faults_table, summary_table, violations
from tandem_dev.chaos.run import ChaosArgs, measure, say
from tandem_dev.local_stack import MODEL, LocalStack, deterministic_sim_worker_argv
from tandem_dev.procs import ManagedProcess, free_port

SETTING = "local stack: 3-member etcd, 2 prefill + 2 decode simulated workers, 2 routers"
SETTINGS = ("local", "dev-cluster")
DEV_CLUSTER_KINDS = (*KINDS, "operator")  # the operator leader killed: only where an operator runs


async def run_chaos(args: ChaosArgs, workdir: Path) -> ChaosReport:
    """Start the stack, run the load and the faults, stop everything it started; return what it measured."""

    def worker_argv(role: Role, port: int, bootstrap_port: int | None) -> list[str]:
        argv = deterministic_sim_worker_argv(role, port, bootstrap_port)
        return [*argv, "--sim-inter-token-ms", str(args.inter_token_ms)]

    # restart_etcd=False: the etcd fault starts its member again itself, after ChaosTarget.etcd_down_s.
    stack = LocalStack(workdir, router_port=0, etcd_members=3, worker_argv=worker_argv, say=say, restart_etcd=False)
    second: ManagedProcess | None = None
    stop = asyncio.Event()
    supervisor: asyncio.Task[None] | None = None
    try:
        await stack.start()
        assert stack.router is not None
        # The second router: the first one's command line (discovery, etcd endpoints, TLS when set) on another port.
        port = free_port()
        argv = list(stack.router.argv)
        argv[argv.index("--port") + 1] = str(port)
        second = ManagedProcess("router-1", argv, workdir / "router-1.log").start()
        url = f"http://127.0.0.1:{port}"
        await asyncio.to_thread(second.wait_http, f"{url}/readiness", 60.0)
        supervisor = asyncio.create_task(stack.supervise(stop))
        routers = [Router(stack.router_url, stack.router), Router(url, second)]
        cluster = LocalCluster(stack)
        return await measure(
            args, SETTING, MODEL, routers, lambda http: ChaosTarget(cluster, routers, http, cap_s=args.cap_s)
        )
    finally:
        stop.set()
        if supervisor is not None:
            await supervisor
        if second is not None:
            second.stop()
        await stack.stop()


def save(report: ChaosReport, folder: Path, argv: Sequence[str]) -> Path:
    results = Results.start(folder, argv)
    results.add("chaos", [summary_table(report), faults_table(report)], report.seconds)
    results.doc["violations"] = violations(report)
    # Each stream's outcome, to tell which fault a stream that was not OK met (times: seconds into the load).
    results.doc["streams"] = [
        {"prompt": r.prompt, "started": round(r.started, 3), "first_byte": r.first_byte and round(r.first_byte, 3),
         "ended": round(r.ended, 3), "verdict": verdict.value, "error": r.error[:200], "failovers": r.failovers,
         "router": r.router}
        for r, verdict in zip(report.results, report.verdicts(), strict=True)
    ]  # fmt: skip
    plot_timeline(report, folder / "timeline.png")
    plot_recovery(report, folder / "recovery.png")
    return results.save()


def _parser() -> argparse.ArgumentParser:
    d = ChaosArgs()
    p = argparse.ArgumentParser(prog="tandem chaos", description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    p.add_argument(
        "--setting",
        choices=SETTINGS,
        default=d.setting,
        help="where: the local stack, or the dev cluster with the operator (2 replicas, leader election)",
    )
    p.add_argument("--streams", type=int, default=d.streams, help="at most this many streams (N)")
    p.add_argument("--concurrency", type=int, default=d.concurrency, help="streams at a time (C)")
    p.add_argument("--duration", type=float, default=d.duration_s, help="seconds of load")
    p.add_argument("--seed", type=int, default=d.seed, help="draws the faults, victims and prompts")
    p.add_argument("--faults", type=int, help="faults to inject, one after the other (default: one per kind)")
    p.add_argument(
        "--kinds",
        help=f"fault kinds to draw from (default: all of the setting's): {','.join(KINDS)}, "
        "and on the dev cluster operator",
    )
    p.add_argument("--max-tokens", type=int, default=d.max_tokens, help="tokens per stream")
    p.add_argument("--inter-token-ms", type=float, default=d.inter_token_ms, help="the simulated decode step")
    p.add_argument("--prompts", type=int, default=d.prompts, help="distinct prompts")
    p.add_argument("--hang-s", type=float, default=d.hang_s, help="a stream silent this long is hung")
    p.add_argument("--cap-s", type=float, default=d.cap_s, help="longest wait for one fault's fence or recovery")
    p.add_argument("--results-dir", type=Path, help="where to save (default: build/chaos/<UTC time>)")
    return p


def parse_args(argv: Sequence[str]) -> tuple[ChaosArgs, Path | None]:
    p = _parser()
    ns = p.parse_args(argv)
    known = DEV_CLUSTER_KINDS if ns.setting == "dev-cluster" else KINDS
    kinds = tuple(k for k in (ns.kinds or ",".join(known)).split(",") if k)
    unknown = [k for k in kinds if k not in known]
    if unknown or not kinds:
        p.error(f"--kinds: unknown kind(s) {unknown or kinds!r} for --setting {ns.setting}; known: {','.join(known)}")
    for name in ("streams", "concurrency", "prompts", "max_tokens"):
        if getattr(ns, name) < 1:
            p.error(f"--{name.replace('_', '-')} must be at least 1")
    for name in ("duration", "hang_s", "cap_s"):
        if getattr(ns, name) <= 0:
            p.error(f"--{name.replace('_', '-')} must be positive")
    faults = len(kinds) if ns.faults is None else ns.faults
    if faults < 0 or ns.inter_token_ms < 0:
        p.error("--faults and --inter-token-ms must not be negative")
    args = ChaosArgs(ns.streams, ns.concurrency, ns.duration, ns.seed, faults, kinds, ns.max_tokens,
                     ns.inter_token_ms, ns.prompts, ns.hang_s, ns.cap_s, ns.setting)  # fmt: skip
    return args, ns.results_dir


def main(argv: Sequence[str]) -> int:
    args, folder = parse_args(argv)
    started = time.strftime("%Y%m%dT%H%M%SZ", time.gmtime())
    folder = folder or Path("build") / "chaos" / re.sub(r"[-:]", "", started)
    folder.mkdir(parents=True, exist_ok=True)
    workdir = Path(tempfile.mkdtemp(prefix="tandem-chaos-"))
    if args.setting == "dev-cluster":
        from tandem_dev.chaos import devcluster

        say(f"{devcluster.SETTING}; process logs in {workdir}")
        report = asyncio.run(devcluster.run_devcluster_chaos(args, workdir))
    else:
        say(f"{SETTING}; process logs in {workdir}")
        report = asyncio.run(run_chaos(args, workdir))
    print(summary_table(report).render())
    print(faults_table(report).render())
    saved = save(report, folder, argv)
    say(f"saved: {saved}, {folder / 'timeline.png'}, {folder / 'recovery.png'}")
    broken = violations(report)
    for line in broken:
        print(f"chaos: invariant broken: {line}", file=sys.stderr)
    return 1 if broken else 0
