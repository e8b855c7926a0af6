"""Start simulated workers as real processes, for tests and benchmarks (the router's tests reuse this).

Every worker is a ``ManagedProcess`` (own process group, log file) running ``python -m tandem.cli sim``; it is
returned once ``GET /health`` answers 200. Mooncake listens on all interfaces, so callers run inside a
loopback-only network namespace (``scripts/in-netns.sh``; ``make test`` does this for the whole suite).
"""

from __future__ import annotations

import sys
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path

from tandem_dev.procs import ManagedProcess, free_port

HOST = "127.0.0.1"


@dataclass
class SimWorker:
    proc: ManagedProcess
    port: int
    bootstrap_port: int | None = None

    @property
    def url(self) -> str:
        return f"http://{HOST}:{self.port}"


def start_worker(
    name: str,
    log_dir: Path,
    extra: Sequence[str] = (),
    env: Mapping[str, str] | None = None,
    port: int | None = None,
    wait: bool = True,
    timeout: float = 60.0,
) -> SimWorker:
    port = port or free_port()
    argv = [sys.executable, "-m", "tandem.cli", "sim", "--model-path", "sim/model", "--host", HOST, "--port", str(port)]
    argv += list(extra)
    bootstrap = None
    if "--disaggregation-bootstrap-port" in extra:
        bootstrap = int(extra[list(extra).index("--disaggregation-bootstrap-port") + 1])
    proc = ManagedProcess(name, argv, log_dir / f"{name}.log", env=env).start()
    worker = SimWorker(proc, port, bootstrap)
    if wait:
        proc.wait_http(f"{worker.url}/health", timeout=timeout)
    return worker


def start_prefill(
    name: str, log_dir: Path, extra: Sequence[str] = (), env: Mapping[str, str] | None = None, **kw: object
) -> SimWorker:
    bootstrap = str(free_port())
    args = ["--disaggregation-mode", "prefill", "--disaggregation-bootstrap-port", bootstrap, *extra]
    return start_worker(name, log_dir, args, env, **kw)  # type: ignore[arg-type]


def start_decode(
    name: str, log_dir: Path, extra: Sequence[str] = (), env: Mapping[str, str] | None = None, **kw: object
) -> SimWorker:
    return start_worker(name, log_dir, ["--disaggregation-mode", "decode", *extra], env, **kw)  # type: ignore[arg-type]


def pd_fields(prefill: SimWorker, room: int) -> dict[str, object]:
    """The fields a router injects into the body sent to both workers."""
    return {"bootstrap_host": HOST, "bootstrap_port": prefill.bootstrap_port, "bootstrap_room": room}
