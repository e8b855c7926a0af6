"""Smoke tests of the built ``tandem`` image: its own entrypoint, user, env and working directory, run from the
unpacked image (tandem_dev.images.run: private mounts + chroot as uid 65532) in the test's loopback-only namespace.
The simulated workers run outside the image, as SGLang pods would next to the router's pod.
"""

from __future__ import annotations

import importlib.metadata
import re
import subprocess
from pathlib import Path

import aiohttp
import pytest

from tandem_dev.images.run import Unpacked, container_argv
from tandem_dev.images.spec import ROOT, project_version, read_debian_lock
from tandem_dev.procs import ManagedProcess, free_port
from tandem_dev.sim.testing import start_decode, start_prefill
from tests.plumbing.imagehelpers import UID, process_ids, tandem_image

pytestmark = [pytest.mark.netns, pytest.mark.timeout(180)]
__all__ = ["tandem_image"]


def test_the_entrypoint_prints_its_help(tandem_image: Unpacked) -> None:
    out = subprocess.run(container_argv(tandem_image, ["--help"]), capture_output=True, text=True, timeout=60)
    assert out.returncode == 0, out.stderr
    for command in ("router", "operator", "sim"):
        assert command in out.stdout


def test_the_default_command_is_the_routers_help(tandem_image: Unpacked) -> None:
    out = subprocess.run(container_argv(tandem_image), capture_output=True, text=True, timeout=60)
    assert out.returncode == 0, out.stderr
    assert "--prefill" in out.stdout


def test_the_image_cannot_write_outside_tmp_as_its_user(tandem_image: Unpacked) -> None:
    """uid 65532 owns nothing in the image: the venv and / are read-only to it."""
    script = "id -u && ! touch /opt/tandem/x 2>/dev/null && ! touch /x 2>/dev/null && touch /tmp/x"
    probe = container_argv(tandem_image, ["-c", script], entrypoint=["/bin/sh"])
    out = subprocess.run(probe, capture_output=True, text=True, timeout=60)
    assert out.returncode == 0, out.stderr
    assert out.stdout.split() == [str(UID)]


def _dist_versions(site: Path) -> dict[str, str]:
    return {d.name.lower().replace("_", "-"): d.version for d in importlib.metadata.distributions(path=[str(site)])}


def test_the_image_holds_the_pinned_python_and_debian_packages_and_no_dev_tooling(tandem_image: Unpacked) -> None:
    root = tandem_image.rootfs
    installed = _dist_versions(root / "opt/tandem/lib/python3.11/site-packages")
    pins = dict(line.split("==") for line in (ROOT / "constraints.txt").read_text().split() if "==" in line)
    pins = {k.lower().replace("_", "-"): v for k, v in pins.items()}
    assert installed.pop("tandem") == project_version()
    assert {name: version for name, version in installed.items() if pins.get(name) != version} == {}
    for dev in ("pip", "setuptools", "pytest", "mypy", "ruff", "mooncake-transfer-engine-non-cuda"):
        assert dev not in installed
    status = (root / "var/lib/dpkg/status").read_text().split("\n\n")
    debs = {f["Package"]: f["Version"] for f in (dict(re.findall(r"^(\w[\w-]*): (.*)$", s, re.M)) for s in status) if f}
    assert {name: debs.get(name) for name in read_debian_lock()} == read_debian_lock()
    assert not [name for name in debs if name.endswith("-dev") or name in ("gcc", "make", "build-essential")]
    assert (root / "etc/passwd").read_text().splitlines()[-1] == "tandem:x:65532:65532::/nonexistent:/usr/sbin/nologin"


async def test_the_router_serves_readiness_in_front_of_simulated_workers(
    tandem_image: Unpacked, tmp_path: Path, proc_factory: list[ManagedProcess]
) -> None:
    prefill = start_prefill("prefill", tmp_path, [])
    decode = start_decode("decode", tmp_path, [])
    proc_factory += [prefill.proc, decode.proc]
    port = free_port()
    args = ["router", "--host", "127.0.0.1", "--port", str(port)]
    args += ["--prefill", prefill.url, str(prefill.bootstrap_port), "--decode", decode.url]
    router = ManagedProcess("router-image", container_argv(tandem_image, args), tmp_path / "router.log").start()
    proc_factory.append(router)
    router.wait_http(f"http://127.0.0.1:{port}/readiness", timeout=90)

    uid, gid, cwd = process_ids(router.pid)
    assert (uid, gid) == (UID, UID)
    assert cwd == str(tandem_image.rootfs)  # WorkingDir "/" of the image
    async with aiohttp.ClientSession() as sess:
        body = {"model": "sim/model", "prompt": "The image runs", "max_tokens": 8}
        async with sess.post(f"http://127.0.0.1:{port}/v1/completions", json=body) as resp:
            doc = await resp.json()
            assert resp.status == 200, doc
    assert doc["choices"][0]["text"]
