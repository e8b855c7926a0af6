"""Start, watch and stop child processes we own, by process group: never by name.

Used by the local stack (``tandem up``), the benchmarks and the tests. Every child runs in its own session
(process group), its output goes to a log file, and ``stop()`` signals the whole group, so grandchildren
(e.g. a shell wrapper's children) go too.
"""

from __future__ import annotations

import contextlib
import os
import signal
import socket
import ssl
import subprocess
import time
import urllib.error
import urllib.request
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path


class ProcessFailedError(RuntimeError):
    """A managed process exited, or did not become ready in time. The message carries its log tail."""


def free_port(host: str = "127.0.0.1") -> int:
    """A TCP port that is free on ``host`` right now (the OS picks it)."""
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as sock:
        sock.bind((host, 0))
        return int(sock.getsockname()[1])


@dataclass
class ManagedProcess:
    """One child process in its own process group, logging to ``log_path``."""

    name: str
    argv: Sequence[str]
    log_path: Path
    env: Mapping[str, str] | None = None
    cwd: Path | None = None
    popen: subprocess.Popen[bytes] | None = field(default=None, init=False)

    def start(self) -> ManagedProcess:
        self.log_path.parent.mkdir(parents=True, exist_ok=True)
        env = dict(os.environ)
        if self.env:
            env.update(self.env)
        with self.log_path.open("ab") as log:
            self.popen = subprocess.Popen(
                list(self.argv),
                stdout=log,
                stderr=subprocess.STDOUT,
                stdin=subprocess.DEVNULL,
                env=env,
                cwd=self.cwd,
                start_new_session=True,
            )
        return self

    @property
    def pid(self) -> int:
        if self.popen is None:
            raise ProcessFailedError(f"{self.name} was never started")
        return self.popen.pid

    def alive(self) -> bool:
        return self.popen is not None and self.popen.poll() is None

    def log_tail(self, lines: int = 40) -> str:
        try:
            return "\n".join(self.log_path.read_text(errors="replace").splitlines()[-lines:])
        except FileNotFoundError:
            return "(no log)"

    def wait_http(
        self, url: str, timeout: float = 30.0, expect: int = 200, context: ssl.SSLContext | None = None
    ) -> None:
        """Wait until ``GET url`` answers ``expect`` (over TLS with ``context``); fail early if the process exits."""
        deadline = time.monotonic() + timeout
        last = "no answer"
        while time.monotonic() < deadline:
            if not self.alive():
                raise ProcessFailedError(f"{self.name} exited ({self.returncode()}):\n{self.log_tail()}")
            try:
                with urllib.request.urlopen(url, timeout=2, context=context) as resp:
                    if resp.status == expect:
                        return
                    last = f"HTTP {resp.status}"
            except urllib.error.HTTPError as err:
                last = f"HTTP {err.code}"
                if err.code == expect:
                    return
            except (OSError, urllib.error.URLError) as err:
                last = str(err)
            time.sleep(0.05)
        raise ProcessFailedError(f"{self.name} not ready at {url} after {timeout}s ({last}):\n{self.log_tail()}")

    def returncode(self) -> int | None:
        return None if self.popen is None else self.popen.poll()

    def signal(self, sig: signal.Signals) -> None:
        """Send ``sig`` to the process group (e.g. SIGKILL to simulate a crash)."""
        if self.popen is not None and self.popen.poll() is None:
            with contextlib.suppress(ProcessLookupError):
                os.killpg(self.popen.pid, sig)

    def stop(self, timeout: float = 10.0) -> int | None:
        """SIGTERM the group, then SIGKILL what is left after ``timeout``. Returns the exit code."""
        if self.popen is None:
            return None
        self.signal(signal.SIGTERM)
        try:
            self.popen.wait(timeout)
        except subprocess.TimeoutExpired:
            self.signal(signal.SIGKILL)
            self.popen.wait(5)
        # Reap stragglers of the group even when the leader already exited.
        with contextlib.suppress(ProcessLookupError, PermissionError):
            os.killpg(self.popen.pid, signal.SIGKILL)
        return self.popen.returncode
