"""``tandem bench`` section ``images``: facts of the built ``tandem`` image (``make bench`` builds it first).

Size (archive, compressed and uncompressed layer), layer count, and start-up times measured side by side from
the image (tandem_dev.images.run: chroot as uid 65532) and from the host's venv: the router until ``/readiness``
answers 200 in front of two instant workers, the operator until ``tandem operator --help`` has imported it
(the operator's start against an API server is covered by tests/operator/test_image_operator.py, not timed).
"""

from __future__ import annotations

import gzip
import statistics
import subprocess
import sys
import tempfile
import time
from collections.abc import Sequence
from pathlib import Path

from tandem_dev.bench import BenchArgs, Table
from tandem_dev.images.build import cached_archive
from tandem_dev.images.oci import ImageArchive
from tandem_dev.images.run import Unpacked, container_argv, unpacked_image
from tandem_dev.images.spec import ImageSpec
from tandem_dev.procs import ManagedProcess, free_port

MIB = 1024 * 1024


def _facts(image: Unpacked) -> Table:
    layers = ImageArchive.read(image.archive).layers
    table = Table("tandem image", ["fact", "value"])
    table.rows += [
        ["digest", image.digest[:19]],
        ["archive (MiB)", image.archive.stat().st_size / MIB],
        ["layers", len(layers)],
        ["compressed layers (MiB)", sum(len(layer) for layer in layers) / MIB],
        ["uncompressed (MiB)", sum(len(gzip.decompress(layer)) for layer in layers) / MIB],
    ]
    return table


def _router_start(argv_for: Sequence[str], port: int, workdir: Path, name: str) -> float:
    started = time.monotonic()
    proc = ManagedProcess(name, list(argv_for), workdir / f"{name}.log").start()
    try:
        proc.wait_http(f"http://127.0.0.1:{port}/readiness", timeout=120)
        return time.monotonic() - started
    finally:
        proc.stop()


def _timed(argv: Sequence[str]) -> float:
    started = time.monotonic()
    subprocess.run(argv, check=True, capture_output=True, timeout=120)
    return time.monotonic() - started


def _startup(image: Unpacked, runs: int) -> Table:
    table = Table("start-up from the image vs the host venv (median s)", ["command", "image", "venv", "image/venv"])
    py = [sys.executable, "-m", "tandem.cli"]
    with tempfile.TemporaryDirectory(prefix="images-bench-") as tmp:
        workdir = Path(tmp)
        workers: list[ManagedProcess] = []
        try:
            urls = []
            for role in ("prefill", "decode"):
                port = free_port()
                argv = [sys.executable, "-m", "tandem_dev.router.instant_worker", "--no-record", "--port", str(port)]
                worker = ManagedProcess(role, [*argv, "--role", role], workdir / f"{role}.log").start()
                workers.append(worker)
                worker.wait_http(f"http://127.0.0.1:{port}/health", timeout=60)
                urls.append(f"http://127.0.0.1:{port}")
            route = ["--prefill", urls[0], "8998", "--decode", urls[1], "--log-level", "warning"]
            image_s, venv_s = [], []
            for i in range(runs):
                port = free_port()
                args = ["router", "--host", "127.0.0.1", "--port", str(port), *route]
                image_s.append(_router_start(container_argv(image, args), port, workdir, f"image-{i}"))
                port = free_port()
                args = ["router", "--host", "127.0.0.1", "--port", str(port), *route]
                venv_s.append(_router_start([*py, *args], port, workdir, f"venv-{i}"))
        finally:
            for worker in workers:
                worker.stop()
    rows = [("tandem router (to /readiness)", statistics.median(image_s), statistics.median(venv_s))]
    op_image = statistics.median(_timed(container_argv(image, ["operator", "--help"])) for _ in range(runs))
    op_venv = statistics.median(_timed([*py, "operator", "--help"]) for _ in range(runs))
    rows.append(("tandem operator --help (imports)", op_image, op_venv))
    table.rows += [[name, a, b, a / b] for name, a, b in rows]
    table.notes.append(f"{runs} runs each, alternating; image runs include unshare + mounts + chroot")
    return table


def run(args: BenchArgs) -> list[Table]:
    archive = cached_archive(ImageSpec())
    if not archive.exists():
        raise RuntimeError(f"the tandem image of this tree is not built ({archive}): run `make images`")
    image = unpacked_image(archive)
    return [_facts(image), _startup(image, 2 if args.quick else 5)]
