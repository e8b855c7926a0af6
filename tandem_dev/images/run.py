"""Runs the built image's own entrypoint, user, env and working directory from its unpacked root filesystem.

No container runtime works in this sandbox (podman and crun: setrlimit refused, hybrid cgroups), so a container
is approximated with what does: a private mount namespace (``unshare --mount``), /proc, /tmp and /run mounted
fresh, a /dev with the devices runc gives every container, the requested volumes bind-mounted read-only, then
``chroot --userspec`` with the image's uid:gid and an environment made only of the image's Env plus what the
caller adds (as Kubernetes adds KUBERNETES_SERVICE_*). Not modelled: cgroup limits, seccomp, capabilities beyond
the uid change, a network namespace of its own (the caller runs it in the test's loopback-only namespace).
"""

from __future__ import annotations

import shlex
import shutil
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from tandem_dev.images import oci
from tandem_dev.images.build import CACHE

RUNTIME_DEVICES = ("null", "zero", "full", "random", "urandom", "tty")


@dataclass(frozen=True)
class Unpacked:
    """An image unpacked once per digest under ~/.cache/tandem/images/unpacked/."""

    archive: Path
    digest: str
    rootfs: Path
    config: dict[str, Any]


def unpacked_image(archive: Path) -> Unpacked:
    """The image archive unpacked (with owners and modes: needs root); reused while its digest is the same."""
    image = oci.ImageArchive.read(archive)
    home = CACHE / "unpacked" / image.digest.split(":", 1)[1][:16]
    rootfs = home / "rootfs"
    if not (home / "complete").exists():
        shutil.rmtree(home, ignore_errors=True)
        image.unpack(rootfs)
        (home / "complete").write_text(image.digest + "\n")
    return Unpacked(archive, image.digest, rootfs, image.config["config"])


def resolve_inside(root: Path, path: str) -> Path:
    """``path`` of the image as a host path under root, following the image's own symlinks (/var/run -> /run)
    inside root, never the host's."""
    resolved = root
    for part in Path(path).relative_to("/").parts:
        candidate = resolved / part
        for _ in range(40):
            if not candidate.is_symlink():
                break
            target = Path(candidate.readlink())
            candidate = root / target.relative_to("/") if target.is_absolute() else candidate.parent / target
        resolved = candidate
    return resolved


def container_argv(
    image: Unpacked,
    args: Sequence[str] | None = None,
    env: Mapping[str, str] | None = None,
    volumes: Mapping[Path, str] | None = None,
    entrypoint: Sequence[str] | None = None,
) -> list[str]:
    """The host command that runs ``ENTRYPOINT + (args or CMD)`` as the image would (needs root); ``volumes`` maps
    host paths to read-only paths inside; ``entrypoint`` overrides the image's (``docker run --entrypoint``)."""
    cfg, root = image.config, image.rootfs
    steps = [
        "mount --make-rprivate /",
        f"mount -t proc proc {root}/proc",
        f"mount -t tmpfs -o mode=1777 tmpfs {root}/tmp",
        f"mount -t tmpfs -o mode=755 tmpfs {root}/run",
        f"mount -t tmpfs -o mode=755 tmpfs {root}/dev",
        f"mkdir {root}/dev/shm && mount -t tmpfs -o mode=1777 tmpfs {root}/dev/shm",
    ]
    for device in RUNTIME_DEVICES:  # what runc gives every container (grpc reads /dev/urandom)
        steps.append(f"touch {root}/dev/{device} && mount --bind /dev/{device} {root}/dev/{device}")
    for host, inside in (volumes or {}).items():
        target = shlex.quote(str(resolve_inside(root, inside)))
        steps += [f"mkdir -p {target}", f"mount --bind -o ro {shlex.quote(str(host))} {target}"]
    environment = [*cfg.get("Env", []), "HOSTNAME=tandem", *(f"{k}={v}" for k, v in (env or {}).items())]
    entry = cfg["Entrypoint"] if entrypoint is None else entrypoint
    command = [*entry, *(cfg.get("Cmd", []) if args is None else args)]
    inner = [
        "chroot", f"--userspec={cfg['User']}", str(root),
        "/usr/bin/env", "-i", *environment,
        "/bin/sh", "-c", 'cd "$0" && exec "$@"', cfg.get("WorkingDir") or "/", *command,
    ]  # fmt: skip
    steps.append("exec " + shlex.join(inner))
    return ["unshare", "--mount", "--fork", "--kill-child", "sh", "-ec", " && ".join(steps)]
