"""``tandem up`` (``make up``): the command line of the embedded local stack (``tandem_dev.local_stack``).

An ordinary mistake ends in one line on stderr naming the setting to change, never a traceback: the router's port
is checked before anything starts (``--port``, ``make up PORT=...``), and a component that exits or never becomes
ready is named with its log file (its log holds the detail). Exit codes: 0 stopped by Ctrl-C/SIGTERM after
serving, 1 a component failed, 2 a setting is wrong, 130 interrupted while starting.
"""

from __future__ import annotations

import argparse
import asyncio
import errno
import os
import signal
import socket
import sys
import tempfile
import time
from collections.abc import Sequence
from pathlib import Path

from tandem_dev.local_stack import HOST, LocalStack
from tandem_dev.procs import ProcessFailedError

PROG = "tandem up"


def port_problem(host: str, port: int) -> str | None:
    """Why the router could not listen on ``host:port`` now, as one line naming the setting; None when it can."""
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as sock:
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)  # as the router's server does
        try:
            sock.bind((host, port))
        except OSError as err:
            why = "is in use" if err.errno == errno.EADDRINUSE else f"cannot be used ({err.strerror})"
            return (
                f"port {port} on {host} (the router's) {why}: choose another with --port "
                f"(make up PORT=...), e.g. --port {port + 1 if port < 65535 else 8000}"
            )
    return None


def failure_line(err: ProcessFailedError, workdir: Path) -> str:
    """A failed component as one line: the first line of the error and where its log is."""
    first = str(err).splitlines()[0].rstrip(":") if str(err) else "a component failed"
    detail = " (a port it needed is in use)" if "address already in use" in str(err).lower() else ""
    return f"{first}{detail}; logs in {workdir}"


def _port(value: str) -> int:
    try:
        port = int(value)
    except ValueError:
        raise argparse.ArgumentTypeError(f"not a port number: {value!r}") from None
    if not 1 <= port <= 65535:
        raise argparse.ArgumentTypeError(f"{port} is not a port number (1-65535)")
    return port


def _count(value: str) -> int:
    try:
        count = int(value)
    except ValueError:
        raise argparse.ArgumentTypeError(f"not a whole number: {value!r}") from None
    if not 1 <= count <= 16:
        raise argparse.ArgumentTypeError(f"{count} is outside 1-16")
    return count


def _examples(url: str, model: str) -> str:
    return f"""
Tandem is up: router {url}  (Ctrl-C stops everything)

  curl -s {url}/v1/chat/completions -H 'Content-Type: application/json' \\
    -d '{{"model": "{model}", "messages": [{{"role": "user", "content": "Hello!"}}], "max_tokens": 32}}'

  python - <<'EOF'
from openai import OpenAI
client = OpenAI(base_url="{url}/v1", api_key="none")
for chunk in client.chat.completions.create(model="{model}", stream=True, max_tokens=32,
                                            messages=[{{"role": "user", "content": "Hello!"}}]):
    print(chunk.choices[0].delta.content or "", end="", flush=True)
print()
EOF

  metrics: {url}/metrics   readiness: {url}/readiness
"""


async def _run(args: argparse.Namespace, workdir: Path) -> int:
    stack = LocalStack(workdir, args.prefills, args.decodes, args.port)
    stop = asyncio.Event()
    loop = asyncio.get_running_loop()
    for sig in (signal.SIGINT, signal.SIGTERM):
        loop.add_signal_handler(sig, stop.set)
    started = time.monotonic()
    try:
        start = asyncio.create_task(stack.start())
        waiter = asyncio.create_task(stop.wait())
        await asyncio.wait({start, waiter}, return_when=asyncio.FIRST_COMPLETED)
        if not start.done():
            start.cancel()
            return 130
        waiter.cancel()
        start.result()
        print(f"ready in {time.monotonic() - started:.1f}s; logs in {workdir}")
        print(_examples(stack.router_url, stack.model), flush=True)
        await stack.supervise(stop)
        return 0
    except ProcessFailedError as err:
        print(f"{PROG}: {failure_line(err, workdir)}", file=sys.stderr)
        return 1
    finally:
        print("stopping ...", flush=True)
        await stack.stop()
        print("stopped.", flush=True)


def main(argv: Sequence[str]) -> int:
    p = argparse.ArgumentParser(prog=PROG, description=__doc__)
    p.add_argument("--port", type=_port, default=8000, help="router port (default 8000; make up PORT=...)")
    p.add_argument("--prefills", type=_count, default=2, help="prefill workers (1-16, default 2)")
    p.add_argument("--decodes", type=_count, default=2, help="decode workers (1-16, default 2)")
    args = p.parse_args(argv)
    if (problem := port_problem(HOST, args.port)) is not None:
        print(f"{PROG}: {problem}", file=sys.stderr)
        return 2
    try:
        workdir = Path(tempfile.mkdtemp(prefix="tandem-up-"))
    except OSError as err:
        where = os.environ.get("TMPDIR", "the temporary directory")
        print(f"{PROG}: cannot create a work directory under {where} ({err.strerror}): set TMPDIR", file=sys.stderr)
        return 2
    import uvloop

    with asyncio.Runner(loop_factory=uvloop.new_event_loop) as runner:
        return runner.run(_run(args, workdir))
