"""The built ``tandem`` image, unpacked, for the smoke tests (tests/test_image_smoke.py, the operator's).

The image is built by ``make images`` (``make test`` runs it first, outside the network namespace where the Debian
mirror and PyPI are reachable) and cached under ~/.cache/tandem/images/<inputs>; a test never builds it.
"""

from __future__ import annotations

import os
from pathlib import Path

import pytest

from tandem_dev.images.build import cached_archive
from tandem_dev.images.run import Unpacked, unpacked_image
from tandem_dev.images.spec import UID, ImageSpec


@pytest.fixture(scope="session")
def tandem_image() -> Unpacked:
    if os.geteuid() != 0:
        pytest.fail("running the image (chroot, mounts, uid 65532) needs root; run the suite as root")
    archive = cached_archive(ImageSpec())
    if not archive.exists():
        pytest.fail(f"the tandem image of this tree is not built ({archive}): run `make images`")
    return unpacked_image(archive)


def process_ids(wrapper_pid: int) -> tuple[int, int, str]:
    """(uid, gid, cwd) of the process the container wrapper (unshare --fork) runs: its only child."""
    children = Path(f"/proc/{wrapper_pid}/task/{wrapper_pid}/children").read_text().split()
    (child,) = children
    status = dict(line.split(":", 1) for line in Path(f"/proc/{child}/status").read_text().splitlines())
    uid, gid = int(status["Uid"].split()[1]), int(status["Gid"].split()[1])  # effective ids
    return uid, gid, os.readlink(f"/proc/{child}/cwd")


__all__ = ["UID", "process_ids", "tandem_image"]
