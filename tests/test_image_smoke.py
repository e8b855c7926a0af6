"""Smoke tests of the built ``tandem`` image: its own entrypoint, user, env and working directory, run from the
unpacked image (tandem.images.run: private mounts + chroot as uid 65532) in the test's loopback-only namespace.
The simulated workers run outside the image, as SGLang pods would next to the router's pod.
"""

from __future__ import annotations

import subprocess
from pathlib import Path

import aiohttp
import pytest

from tandem.images.run import Unpacked, container_argv
from tandem.procs import ManagedProcess, free_port
from tandem_sim.testing import start_decode, start_prefill
from tests.imagehelpers import UID, process_ids, tandem_image

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
        body = {"model": "sim", "prompt": "The image runs", "max_tokens": 8}
        async with sess.post(f"http://127.0.0.1:{port}/v1/completions", json=body) as resp:
            doc = await resp.json()
            assert resp.status == 200, doc
    assert doc["choices"][0]["text"]
