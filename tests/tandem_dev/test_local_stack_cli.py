"""First runs of `tandem up` and `tandem router`: an ordinary mistake ends in one line naming the setting, never a
traceback (issue #41)."""

from __future__ import annotations

import socket
import subprocess
import sys
from pathlib import Path

import pytest

from tandem_dev.local_stack import HOST
from tandem_dev.local_stack_cli import failure_line, main, port_problem
from tandem_dev.procs import ProcessFailedError

pytestmark = pytest.mark.timeout(60)


def _listening() -> socket.socket:
    sock = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
    sock.bind((HOST, 0))
    sock.listen()
    return sock


def test_a_taken_router_port_is_one_line_naming_the_setting(capsys: pytest.CaptureFixture[str]) -> None:
    with _listening() as taken:
        port = taken.getsockname()[1]
        assert main(["--port", str(port)]) == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1, err
    assert err.startswith(f"tandem up: port {port} on {HOST} (the router's) is in use: choose another with --port")
    assert "make up PORT=" in err


def test_a_free_port_has_no_problem() -> None:
    with socket.socket() as probe:
        probe.bind((HOST, 0))
        port = probe.getsockname()[1]
    assert port_problem(HOST, port) is None


@pytest.mark.parametrize(
    ("argv", "message"),
    [
        (["--port", "0"], "argument --port: 0 is not a port number (1-65535)"),
        (["--port", "eighty"], "argument --port: not a port number: 'eighty'"),
        (["--decodes", "0"], "argument --decodes: 0 is outside 1-16"),
    ],
)
def test_a_bad_setting_names_it(argv: list[str], message: str, capsys: pytest.CaptureFixture[str]) -> None:
    with pytest.raises(SystemExit) as exit_:
        main(argv)
    assert exit_.value.code == 2
    err = capsys.readouterr().err
    assert message in err
    assert "Traceback" not in err


def test_a_component_that_failed_is_one_line_with_its_logs(tmp_path: Path) -> None:
    tail = "Traceback (most recent call last):\n  ...\nOSError: [Errno 98] error while attempting to bind: "
    tail += "address already in use"
    line = failure_line(ProcessFailedError(f"router exited (1):\n{tail}"), tmp_path)
    assert line == f"router exited (1) (a port it needed is in use); logs in {tmp_path}"


@pytest.mark.procs
def test_make_up_with_the_port_taken_prints_one_line(tmp_path: Path) -> None:
    """Through the real entry point, as a first run types it: no traceback, exit code 2."""
    with _listening() as taken:
        port = taken.getsockname()[1]
        done = subprocess.run(
            [sys.executable, "-m", "tandem.cli", "up", "--port", str(port)],
            capture_output=True,
            text=True,
            timeout=50,
            cwd=tmp_path,
        )
    assert done.returncode == 2
    assert done.stdout == ""
    assert done.stderr.splitlines() == [
        f"tandem up: port {port} on {HOST} (the router's) is in use: choose another with --port (make up PORT=...), "
        f"e.g. --port {port + 1}"
    ]


@pytest.mark.procs
def test_tandem_router_on_a_taken_port_prints_one_line(tmp_path: Path) -> None:
    with _listening() as taken:
        port = taken.getsockname()[1]
        argv = ["router", "--host", HOST, "--port", str(port), "--prefill", f"http://{HOST}:9", "--decode",
                f"http://{HOST}:9", "--log-level", "error"]  # fmt: skip
        done = subprocess.run(
            [sys.executable, "-m", "tandem.cli", *argv], capture_output=True, text=True, timeout=50, cwd=tmp_path
        )
    assert done.returncode == 2
    assert done.stderr.splitlines() == [f"tandem router: {HOST}:{port} is in use: choose another --port (or --host)"]
