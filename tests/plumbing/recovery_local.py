"""A decode restarted under load at its old Mooncake session id, on plain local processes (issue #18).

1 prefill + 1 decode (``tandem sim``, real Mooncake TCP) behind a router; clients keep sending requests; the decode
is killed and started again on the same HTTP port and the same session id ``127.0.0.1:<rpc port>``. The old TCP
data port is still held by the dead process's socket (the prefill's pooled connection to it sits in CLOSE-WAIT), so
the new process takes the other port of its range as data port: the prefill's cached segment descriptor for that
session names a port nobody listens on. Measured: the time from the new decode answering ``/health`` to the router
serving again, and how many requests failed meanwhile.

``python -m tests.plumbing.recovery_local`` prints the measurement with SGLang's and Mooncake's defaults and with
Tandem's (inside the loopback-only namespace: ``scripts/in-netns.sh .venv/bin/python -m tests.plumbing.recovery_local``;
``--tandem-defaults --runs 6``: Tandem's cases only, 6 runs each) and saves it with the run's context to
``build/records/tests.plumbing.recovery_local.json`` (tandem_dev.records). The router runs at its defaults (health
checks every 2 s), as the chart runs it.
"""

from __future__ import annotations

import argparse
import asyncio
import dataclasses
import random
import signal
import socket
import sys
import tempfile
import time
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path

import aiohttp

from tandem.registry import Role
from tandem_dev import records
from tandem_dev.local_stack import MODEL, RECOVERY_ENV, sim_worker_argv
from tandem_dev.procs import ManagedProcess, free_port

HOST = "127.0.0.1"
CLIENTS = 8


@dataclass
class Recovery:
    """Outcome of one restart: ``recovered_s`` is None when the router had not served again within the cap."""

    recovered_s: float | None
    failed_while_down: int
    served_after: int
    failed_after: int
    statuses: dict[int, int] = field(default_factory=dict)


def _free_run(count: int) -> int:
    """The first of ``count`` consecutive ports that are free now, below the ephemeral range (Mooncake ignores a
    range inside 32768-60999 and falls back to its default, 15000-17000)."""
    rng = random.Random()
    while True:
        base = rng.randrange(20000, 32000)
        if all(_bindable(base + i) for i in range(count)):
            return base


def _bindable(port: int) -> bool:
    with socket.socket() as s:
        try:
            s.bind(("0.0.0.0", port))
        except OSError:
            return False
    return True


def _worker(
    name: str, log_dir: Path, role: Role, port: int, bootstrap: int | None, env: Mapping[str, str]
) -> ManagedProcess:
    argv = [*sim_worker_argv(role, port, bootstrap), "--sim-inter-token-ms", "5"]
    return ManagedProcess(name, argv, log_dir / f"{name}.log", env=dict(env)).start()


async def _session(http: aiohttp.ClientSession, url: str) -> str:
    async with http.get(f"{url}/server_info") as resp:
        info = await resp.json()
    return str(info["internal_states"][0]["session_id"])


async def _healthy(http: aiohttp.ClientSession, proc: ManagedProcess, url: str, within: float) -> bool:
    deadline = time.monotonic() + within
    while time.monotonic() < deadline and proc.alive():
        try:
            async with http.get(f"{url}/health", timeout=aiohttp.ClientTimeout(total=1)) as resp:
                if resp.status == 200:
                    return True
        except (aiohttp.ClientError, TimeoutError):
            pass
        await asyncio.sleep(0.05)
    return False


async def _restart_at(
    http: aiohttp.ClientSession,
    log_dir: Path,
    port: int,
    session: str,
    data_port: int,
    env: Mapping[str, str],
    same_data_port: bool,
) -> ManagedProcess:
    """Start the decode again until it comes up under ``session``: with ``same_data_port`` in its old window (the
    dead process's ports are free again about 60 s after the kill: TIME_WAIT and orphaned sockets), else in the old
    RPC port and a fresh one, never the old data port. Attempts under another session are stopped before any peer
    meets them."""
    rpc = int(session.rsplit(":", 1)[1])
    other = data_port if same_data_port else (rpc - 1 if data_port == rpc + 1 else rpc + 1)
    window = {"MC_MIN_RPC_PORT": str(min(rpc, other)), "MC_MAX_RPC_PORT": str(max(rpc, other))}
    url = f"http://{HOST}:{port}"
    outcomes: dict[str, int] = {}
    for attempt in range(100):
        proc = _worker(f"decode-{attempt + 1}", log_dir, Role.DECODE, port, None, {**env, **window})
        if not await _healthy(http, proc, url, 60):
            outcome = "not healthy" if proc.alive() else "exited"
        elif (got := await _session(http, url)) != session:
            outcome = f"session {got}"
        else:
            return proc
        outcomes[outcome] = outcomes.get(outcome, 0) + 1
        proc.stop()
    raise RuntimeError(f"the decode never came back under {session} (window {window}): {outcomes}; logs in {log_dir}")


async def _load(router: str, stop: asyncio.Event, log: list[tuple[float, int]]) -> None:
    body = {"model": MODEL, "prompt": "tell me about the sea", "max_tokens": 4, "temperature": 0}
    timeout = aiohttp.ClientTimeout(total=30)
    async with aiohttp.ClientSession(timeout=timeout) as http:

        async def client() -> None:
            while not stop.is_set():
                try:
                    async with http.post(f"{router}/v1/completions", json=body) as resp:
                        await resp.read()
                        log.append((time.monotonic(), resp.status))
                except (aiohttp.ClientError, TimeoutError):
                    log.append((time.monotonic(), 0))
                if log[-1][1] != 200:
                    await asyncio.sleep(0.05)  # a client that failed tries again soon, not in a busy loop

        await asyncio.gather(*(client() for _ in range(CLIENTS)))


async def restart_decode_under_load(
    log_dir: Path, env: Mapping[str, str], cap_s: float = 60.0, same_data_port: bool = False
) -> Recovery:
    """Run the scenario once with ``env`` on both workers; every process it starts is stopped before it returns.

    ``same_data_port``: the new decode also gets the old TCP data port (the prefill's cached descriptor is right,
    but its pooled connections to that port are the dead process's), else another one."""
    base = _free_run(4)  # the decode's window [base + 1, base + 2]: either neighbour is free ...
    other = _free_run(2)
    while other + 1 >= base and other <= base + 3:  # ... so the prefill's window must not take one of them
        other = _free_run(2)
    prefill_env = {**env, "MC_MIN_RPC_PORT": str(other), "MC_MAX_RPC_PORT": str(other + 1)}
    decode_env = {**env, "MC_MIN_RPC_PORT": str(base + 1), "MC_MAX_RPC_PORT": str(base + 2)}
    # The decode's HTTP port is bound again after the kill, so it too lies below the ephemeral range: an ephemeral
    # one can meanwhile become the local port of any outgoing connection on the machine, and the restart would
    # find it taken.
    d_port = _free_run(1)
    while base - 1 <= d_port <= base + 4 or other - 1 <= d_port <= other + 2:
        d_port = _free_run(1)
    p_port, bootstrap, r_port = free_port(), free_port(), free_port()
    procs = [
        _worker("prefill", log_dir, Role.PREFILL, p_port, bootstrap, prefill_env),
        _worker("decode-0", log_dir, Role.DECODE, d_port, None, decode_env),
    ]
    router = f"http://{HOST}:{r_port}"
    stop = asyncio.Event()
    log: list[tuple[float, int]] = []
    try:
        for proc, port in zip(procs, (p_port, d_port), strict=True):
            await asyncio.to_thread(proc.wait_http, f"http://{HOST}:{port}/health", 120.0)
        argv = [sys.executable, "-m", "tandem.cli", "router", "--host", HOST, "--port", str(r_port),
                "--prefill", f"http://{HOST}:{p_port}", str(bootstrap),
                "--decode", f"http://{HOST}:{d_port}"]  # fmt: skip
        procs.append(ManagedProcess("router", argv, log_dir / "router.log").start())
        await asyncio.to_thread(procs[-1].wait_http, f"{router}/readiness", 60.0)
        load = asyncio.create_task(_load(router, stop, log))
        async with aiohttp.ClientSession() as http:
            session = await _session(http, f"http://{HOST}:{d_port}")
            # Served enough that the prefill holds pooled connections to the decode.
            await _wait_for(lambda: sum(status == 200 for _, status in log) >= 20, 120.0)
            data_port = _data_port(log_dir / "decode-0.log")
            procs[1].signal(signal.SIGKILL)
            procs[1].stop()
            procs[1] = await _restart_at(http, log_dir, d_port, session, data_port, env, same_data_port)
        back = time.monotonic()
        await _wait_for(lambda: any(t > back and s == 200 for t, s in log), cap_s)
        served = [t for t, s in log if t > back and s == 200]
        await asyncio.sleep(3.0)  # then it keeps serving
        stop.set()
        await load
    finally:
        stop.set()
        for proc in reversed(procs):
            proc.stop()
    first = min(served) if served else None
    statuses: dict[int, int] = {}
    for _, status in log:
        statuses[status] = statuses.get(status, 0) + 1
    after = [s for t, s in log if first is not None and t > first]
    return Recovery(
        recovered_s=round(first - back, 2) if first is not None else None,
        failed_while_down=sum(s != 200 and (first is None or t <= first) for t, s in log),
        served_after=sum(s == 200 for s in after),
        failed_after=sum(s != 200 for s in after),
        statuses=statuses,
    )


async def _wait_for(condition: Callable[[], bool], within: float) -> bool:
    deadline = time.monotonic() + within
    while time.monotonic() < deadline:
        if condition():
            return True
        await asyncio.sleep(0.05)
    return False


def _data_port(log: Path) -> int:
    """The TCP data port Mooncake chose (its own log line on the worker's stderr)."""
    for line in log.read_text().splitlines():
        if "TcpTransport: listen on port" in line:
            return int(line.rsplit(" ", 1)[1])
    raise RuntimeError(f"no Mooncake data port in {log}")


def main(argv: Sequence[str]) -> None:
    """Every case once; ``--tandem-defaults`` only the two with Tandem's settings, ``--runs N`` times each."""
    parser = argparse.ArgumentParser(prog="python -m tests.plumbing.recovery_local")
    parser.add_argument("--tandem-defaults", action="store_true", help="only the cases with Tandem's defaults")
    parser.add_argument("--runs", type=int, default=1, help="runs of each case")
    args = parser.parse_args(argv)
    cases = [
        ("other data port", False, "SGLang + Mooncake defaults", {}),
        ("other data port", False, "Tandem defaults", RECOVERY_ENV),
        ("same data port", True, "SGLang + Mooncake defaults", {}),
        ("same data port", True, "Tandem defaults", RECOVERY_ENV),
    ]
    print("| decode back under its old session id, | settings | time to serve again | failed meanwhile "
          "| served / failed in the next 3 s |")  # fmt: skip
    print("|---|---|---|---|---|")
    runs: list[dict[str, object]] = []
    for case, same, label, env in cases:
        for _ in range(args.runs if env or not args.tandem_defaults else 0):
            with tempfile.TemporaryDirectory() as tmp:
                r = asyncio.run(restart_decode_under_load(Path(tmp), env, cap_s=180.0, same_data_port=same))
            recovered = f"{r.recovered_s} s" if r.recovered_s is not None else "not within 180 s"
            print(f"| {case} | {label} | {recovered} | {r.failed_while_down} | {r.served_after} / {r.failed_after} |")
            runs.append({"case": case, "settings": label, **dataclasses.asdict(r)})
    command = ["python", "-m", "tests.plumbing.recovery_local", *argv]
    saved = records.save("tests.plumbing.recovery_local", {"runs": runs}, command)
    print(f"saved: {saved}")


if __name__ == "__main__":
    main(sys.argv[1:])
