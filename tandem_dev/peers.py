"""Benchmark and conformance peers: SGLang's own tools Tandem is measured against or checked by, installed pinned.

Each peer lives in a cache under ``~/.cache/tandem/`` (``$TANDEM_CACHE``) keyed by its pins, so a changed pin
installs a new copy and an unchanged one is reused by every worktree and fresh clone. Installing needs a package
registry, which the loopback-only network namespace of the tests and benches cannot reach, so ``make peers``
(``python -m tandem_dev.peers_install install``, run by ``make test`` and ``make bench`` outside the namespace)
installs them, and code inside the namespace only *looks them up* (``require``), failing with the peer's name and
that command.

- ``smg``: SGLang's Rust PD router (PyPI ``smg``), in a venv with every transitive version pinned.
- ``sglang-wheel``: the ``sglang`` wheel itself (hash-checked), read by ``scripts/gen_sglang_flags.py``.
- ``sglang-parser``: a venv with the pinned ``sglang`` wheel (``--no-deps``), the pinned torch it requires
  and the few packages ``sglang.srt.server_args`` imports, so tests can run SGLang's real
  ``prepare_server_args`` (tests/conformance/sglang_parse.py) without a GPU.
- ``wrk``: the HTTP load generator (Debian package, installed by scripts/bootstrap.sh).
"""

from __future__ import annotations

import hashlib
import os
import shutil
import subprocess
import sys
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from importlib import resources
from pathlib import Path

from tandem.sglang_args import SGLANG_VERSION

CACHE = Path(os.environ.get("TANDEM_CACHE", Path.home() / ".cache" / "tandem"))
WHEELS = CACHE / "wheels"
# sha256 of sglang-0.5.23-cp311-cp311-manylinux_2_34_x86_64.whl as PyPI serves it.
SGLANG_WHEEL = f"sglang-{SGLANG_VERSION}-cp311-cp311-manylinux_2_34_x86_64.whl"
SGLANG_WHEEL_SHA256 = "00b3cd5b265ac76c64185fbb6b95424f324ddd9f428d0306b77bc9db9d859937"
INSTALL_HINT = "run `make peers` (outside the network namespace: it needs PyPI)"


class PeerMissingError(RuntimeError):
    """A peer is not installed here; the message names it and how to install it."""


def _pins(name: str) -> str:
    return resources.files("tandem_dev").joinpath("data", "peers", f"{name}.txt").read_text()


def pinned_version(name: str, package: str) -> str:
    """The version ``package`` is pinned to in ``tandem_dev/data/peers/<name>.txt``."""
    for line in _pins(name).splitlines():
        if line.lower().startswith(f"{package.lower()}=="):
            return line.split("==", 1)[1].strip()
    raise KeyError(f"{package} is not pinned in tandem_dev/data/peers/{name}.txt")


def _venv_dir(name: str) -> Path:
    key = hashlib.sha256((_pins(name) + SGLANG_WHEEL_SHA256).encode()).hexdigest()[:12]
    return CACHE / "peers" / f"{name}-{key}"


def _venv_python(name: str) -> Path | None:
    venv = _venv_dir(name)
    return venv / "bin" / "python" if (venv / ".installed").exists() else None


def _pip(python: Path, *args: str) -> None:
    subprocess.run([str(python), "-m", "pip", "install", "-q", "--disable-pip-version-check", *args], check=True)


def _install_venv(name: str, extra: Callable[[Path], None] | None = None) -> None:
    """Create the venv for ``name`` with every package of tandem_dev/data/peers/<name>.txt, unless it is complete."""
    if _venv_python(name) is not None:
        return
    venv = _venv_dir(name)
    shutil.rmtree(venv, ignore_errors=True)  # a half-built venv from an interrupted install
    subprocess.run([sys.executable, "-m", "venv", str(venv)], check=True)
    python = venv / "bin" / "python"
    pins = venv / "pins.txt"
    pins.write_text(_pins(name))
    _pip(python, "-r", str(pins))
    if extra is not None:
        extra(python)
    (venv / ".installed").write_text(_pins(name))


# -- the peers ---------------------------------------------------------------------------------------------------
def smg_python() -> Path | None:
    """The Python of the pinned ``smg`` venv (run ``python -m smg.launch_router``), or None."""
    return _venv_python("smg")


def smg_version() -> str:
    return pinned_version("smg", "smg")


def smg_argv(
    prefills: Sequence[tuple[str, int | None]],
    decodes: Sequence[str],
    port: int,
    metrics_port: int,
    policy: str = "round_robin",
) -> list[str]:
    """``smg`` in PD mode on 127.0.0.1: every (prefill URL, bootstrap port) and decode URL, with ``policy``."""
    argv = [str(require("smg")), "-m", "smg.launch_router", "--pd-disaggregation"]
    for url, bootstrap in prefills:
        argv += ["--prefill", url, "none" if bootstrap is None else str(bootstrap)]
    for url in decodes:
        argv += ["--decode", url]
    argv += ["--host", "127.0.0.1", "--port", str(port), "--policy", policy]
    return [*argv, "--prometheus-host", "127.0.0.1", "--prometheus-port", str(metrics_port)]  # default 0.0.0.0:29000


def sglang_wheel() -> Path | None:
    """The pinned, hash-checked sglang wheel in ``~/.cache/tandem/wheels``, or None."""
    path = WHEELS / SGLANG_WHEEL
    return path if path.exists() and _sha256(path) == SGLANG_WHEEL_SHA256 else None


def sglang_parser_python() -> Path | None:
    """The Python of the venv with SGLang's real ``prepare_server_args`` (sglang + CPU-usable torch), or None."""
    return _venv_python("sglang-parser")


def wrk_binary() -> Path | None:
    found = shutil.which("wrk")
    return Path(found) if found else None


def _sha256(path: Path) -> str:
    digest = hashlib.sha256()
    with path.open("rb") as f:
        for block in iter(lambda: f.read(1 << 20), b""):
            digest.update(block)
    return digest.hexdigest()


def _install_smg() -> None:
    _install_venv("smg")


def _install_sglang_wheel() -> None:
    if sglang_wheel() is not None:
        return
    WHEELS.mkdir(parents=True, exist_ok=True)
    cmd = [sys.executable, "-m", "pip", "download", "--no-deps", "-q", "--disable-pip-version-check"]
    subprocess.run([*cmd, f"sglang=={SGLANG_VERSION}", "-d", str(WHEELS)], check=True)
    if sglang_wheel() is None:
        raise PeerMissingError(f"{WHEELS / SGLANG_WHEEL} is missing or its sha256 is not {SGLANG_WHEEL_SHA256}")


def _install_sglang_parser() -> None:
    _install_sglang_wheel()
    wheel = sglang_wheel()
    assert wheel is not None
    _install_venv("sglang-parser", lambda python: _pip(python, "--no-deps", str(wheel)))


@dataclass(frozen=True)
class Peer:
    name: str
    version: Callable[[], str]
    locate: Callable[[], Path | None]
    install: Callable[[], None]
    how: str  # how to install it, for the error message


PEERS: dict[str, Peer] = {
    "smg": Peer("smg", smg_version, smg_python, _install_smg, INSTALL_HINT),
    "sglang-wheel": Peer("sglang-wheel", lambda: SGLANG_VERSION, sglang_wheel, _install_sglang_wheel, INSTALL_HINT),
    "sglang-parser": Peer(
        "sglang-parser",
        lambda: f"sglang {SGLANG_VERSION}, torch {pinned_version('sglang-parser', 'torch')}",
        sglang_parser_python,
        _install_sglang_parser,
        INSTALL_HINT,
    ),
    "wrk": Peer("wrk", lambda: _deb_version("wrk"), wrk_binary, lambda: None, "run scripts/bootstrap.sh (apt wrk)"),
}


def _deb_version(package: str) -> str:
    try:
        out = subprocess.run(
            ["dpkg-query", "-W", "-f=${Version}", package], capture_output=True, text=True, check=False, timeout=10
        )
    except OSError:
        return "unknown"
    return out.stdout.strip() or "not installed"


def require(name: str) -> Path:
    """The installed peer's path; ``PeerMissingError`` naming the peer and how to install it when it is not."""
    peer = PEERS[name]
    found = peer.locate()
    if found is None:
        raise PeerMissingError(f"peer {name} ({peer.version()}) is not installed here: {peer.how}")
    return found


def versions() -> dict[str, str]:
    """Every peer's pinned version and whether it is installed here (for benchmark result files)."""
    return {name: f"{p.version()}{'' if p.locate() else ' (not installed)'}" for name, p in PEERS.items()}
