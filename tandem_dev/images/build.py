"""``make images``: builds the ``tandem`` image as an OCI archive without a Docker engine.

Steps (root is needed for debootstrap, chroot and mounts; every mount lives in a private mount namespace):
1. the pinned wheels (``pip wheel -c constraints.txt .`` plus pip itself), on the host, where PyPI is reachable;
2. ``debootstrap --variant=minbase <suite>`` from deb.debian.org;
3. in a chroot, the same commands the generated Dockerfile runs (tandem_dev.images.spec): the Debian packages at the
   versions in images/tandem/debian.lock, a venv with the wheels installed offline, the uid 65532 user;
4. the root filesystem as one reproducible layer (tandem_dev.images.oci), written to ~/.cache/tandem/images/<key>/
   and copied to build/images/. <key> hashes every input, so an unchanged tree is not rebuilt.
"""

from __future__ import annotations

import argparse
import hashlib
import os
import re
import shlex
import shutil
import subprocess
import sys
import tempfile
import time
from pathlib import Path

from tandem_dev import records
from tandem_dev.images import oci
from tandem_dev.images.spec import (
    DEBIAN_LOCK,
    PIP_VERSION,
    ROOT,
    WHEELS_DIR,
    ImageSpec,
    apt_install_command,
    install_commands,
    read_debian_lock,
)

MIRROR = "http://deb.debian.org/debian"
CACHE = Path.home() / ".cache" / "tandem" / "images"
OUT = ROOT / "build" / "images"
# Host tools and the Debian package each comes from (scripts/bootstrap.sh --images installs them).
TOOLS = {"debootstrap": "debootstrap", "chroot": "coreutils", "unshare": "util-linux", "mount": "mount"}
SOURCES = ("pyproject.toml", "constraints.txt", "README.md", "tandem", "simulator", "router", "operator")
# Left by debootstrap/apt/ldconfig and different on every run, or the host's (Docker and kubelet provide them).
VOLATILE = (
    "etc/resolv.conf",
    "etc/hostname",
    "var/cache/ldconfig/aux-cache",
    "var/cache/apt/pkgcache.bin",
    "var/cache/apt/srcpkgcache.bin",
    "var/lib/dpkg/available-old",
    "var/lib/dpkg/status-old",
    "var/lib/dpkg/diversions-old",
    "var/log/bootstrap.log",
    "var/log/alternatives.log",
)


class BuildError(RuntimeError):
    """A build that cannot go on, with a message naming what is missing or wrong."""


def log(msg: str) -> None:
    print(f"images: {msg}", file=sys.stderr, flush=True)


def check_host() -> None:
    """Fails naming every missing tool (and its Debian package), or a missing root."""
    missing = [f"{tool} (Debian package {pkg})" for tool, pkg in TOOLS.items() if shutil.which(tool) is None]
    if missing:
        raise BuildError(f"missing host tools: {', '.join(missing)}; install them with scripts/bootstrap.sh --images")
    if os.geteuid() != 0:
        raise BuildError("building the image needs root (debootstrap, chroot and mounts); run it as root")


def source_epoch() -> int:
    """SOURCE_DATE_EPOCH if set, else the time of the last commit that changed an input (not HEAD's, so a commit
    elsewhere keeps the cached image): every mtime and ``created`` is clamped to it."""
    if env := os.environ.get("SOURCE_DATE_EPOCH"):
        return int(env)
    argv = ["git", "log", "-1", "--format=%ct", "--", *SOURCES, "images/tandem"]
    out = subprocess.run(argv, cwd=ROOT, capture_output=True, text=True, check=True)
    return int(out.stdout.strip())


def input_key(spec: ImageSpec, epoch: int) -> str:
    """A hash of everything the image is made of: spec, Debian pins, constraints and the tracked sources."""
    files = subprocess.run(
        ["git", "ls-files", "-z", "--", *SOURCES], cwd=ROOT, capture_output=True, check=True
    ).stdout.split(b"\0")
    h = hashlib.sha256(repr((spec, install_commands(), epoch, MIRROR)).encode())
    h.update(DEBIAN_LOCK.read_bytes() if DEBIAN_LOCK.exists() else b"")
    for name in sorted(f for f in files if f):
        path = ROOT / name.decode()
        if path.is_file():
            h.update(name + b"\0" + hashlib.sha256(path.read_bytes()).digest())
    return h.hexdigest()[:16]


def run(argv: list[str], **kw: object) -> None:
    log("$ " + shlex.join(argv))
    subprocess.run(argv, check=True, **kw)  # type: ignore[call-overload]


def chroot_sh(rootfs: Path, command: str, epoch: int) -> None:
    """Runs one shell command in the chroot, with /proc and /dev mounted in a private mount namespace."""
    mounts = [f"mount -t proc proc {rootfs}/proc", f"mount --rbind /dev {rootfs}/dev"]
    env = f"env -i PATH=/usr/sbin:/usr/bin:/sbin:/bin HOME=/root LANG=C.UTF-8 SOURCE_DATE_EPOCH={epoch}"
    script = " && ".join(
        ["mount --make-rprivate /", *mounts, f"{env} chroot {rootfs} /bin/sh -c {shlex.quote(command)}"]
    )
    run(["unshare", "--mount", "--fork", "sh", "-c", script])


def fetch_wheels(dest: Path, epoch: int) -> None:
    """The tandem wheel and every pinned dependency, plus pip itself (run from its wheel inside the image)."""
    env = {**os.environ, "SOURCE_DATE_EPOCH": str(epoch)}
    pip = [sys.executable, "-m", "pip", "--disable-pip-version-check", "-q"]
    run([*pip, "wheel", "--wheel-dir", str(dest), "-c", "constraints.txt", "."], cwd=ROOT, env=env)
    run([*pip, "download", "--no-deps", "--only-binary=:all:", "-d", str(dest), f"pip=={PIP_VERSION}"], env=env)
    shutil.copy(ROOT / "constraints.txt", dest / "constraints.txt")


def debootstrap(rootfs: Path, spec: ImageSpec) -> None:
    run(["debootstrap", "--variant=minbase", spec.suite, str(rootfs), MIRROR], stdout=subprocess.DEVNULL)


_INST = re.compile(r"^Inst (\S+) \((\S+) ")


def relock(rootfs: Path, spec: ImageSpec, epoch: int) -> None:
    """Writes images/tandem/debian.lock: the versions apt would install today for the spec's packages."""
    wanted = " ".join(spec.packages)
    out = rootfs / "tmp" / "apt-plan.txt"
    chroot_sh(
        rootfs, f"apt-get update -qq && apt-get install -s --no-install-recommends {wanted} > /tmp/apt-plan.txt", epoch
    )
    pins = {m[1]: m[2] for line in out.read_text().splitlines() if (m := _INST.match(line))}
    out.unlink()
    header = f"# Debian packages installed on top of {spec.suite} minbase (apt's plan for: {wanted}).\n"
    header += "# Regenerate with `make images-relock` when the mirror has moved on (a pin is no longer found).\n"
    DEBIAN_LOCK.write_text(header + "".join(f"{n}={v}\n" for n, v in sorted(pins.items())))
    log(f"wrote {DEBIAN_LOCK.relative_to(ROOT)} ({len(pins)} packages)")


def strip_volatile(rootfs: Path) -> None:
    """Removes host- and run-specific files; /dev, /proc, /run and /tmp stay as empty directories."""
    for rel in VOLATILE:
        (rootfs / rel).unlink(missing_ok=True)
    for rel in ("dev", "proc", "run", "tmp", "var/lib/apt/lists", "var/cache/apt/archives"):
        d = rootfs / rel
        for child in d.iterdir() if d.is_dir() else ():
            if child.is_dir() and not child.is_symlink():
                shutil.rmtree(child)
            else:
                child.unlink()


def image_config(spec: ImageSpec) -> dict[str, object]:
    return {
        "User": spec.user,
        "Entrypoint": list(spec.entrypoint),
        "Cmd": list(spec.cmd),
        "Env": [f"{k}={v}" for k, v in spec.env],
        "WorkingDir": spec.workdir,
        "Labels": dict(spec.labels),
        "ExposedPorts": {p: {} for p in spec.exposed_ports},
    }


def cached_archive(spec: ImageSpec) -> Path:
    """Where the image of the current inputs lives in the cache (it may not be built yet)."""
    return CACHE / input_key(spec, source_epoch()) / f"{spec.name}.oci.tar"


def build(spec: ImageSpec, *, do_relock: bool = False, force: bool = False) -> Path:
    """Builds (or finds in the cache) the image; returns the archive under build/images/."""
    check_host()
    epoch = source_epoch()
    cached = cached_archive(spec)
    key = cached.parent.name
    target = OUT / f"{spec.name}-{spec.tag.split(':')[1]}.oci.tar"
    if cached.exists() and not (force or do_relock):
        log(f"cached: {cached} (inputs {key})")
    else:
        started = time.monotonic()
        CACHE.mkdir(parents=True, exist_ok=True)
        with tempfile.TemporaryDirectory(dir=CACHE, prefix="work-") as tmp:
            work = Path(tmp)
            wheels, rootfs = work / "wheels", work / "rootfs"
            fetch_wheels(wheels, epoch)
            debootstrap(rootfs, spec)
            if do_relock or not DEBIAN_LOCK.exists():
                relock(rootfs, spec, epoch)
            try:
                chroot_sh(rootfs, apt_install_command(read_debian_lock()), epoch)
            except subprocess.CalledProcessError as e:
                raise BuildError(
                    f"installing the pinned Debian packages failed; if apt says a version was not found, the mirror "
                    f"has moved on: run `make images-relock` and commit {DEBIAN_LOCK.relative_to(ROOT)}"
                ) from e
            shutil.copytree(wheels, rootfs / WHEELS_DIR.lstrip("/"))  # the Dockerfile's COPY --from=wheels
            for command in install_commands():
                chroot_sh(rootfs, command, epoch)
            strip_volatile(rootfs)
            log("writing the layer")
            built = oci.write_archive(
                work / "image.oci.tar", oci.layer_tar(rootfs, epoch), image_config(spec), spec.tag, epoch
            )
            cached.parent.mkdir(parents=True, exist_ok=True)
            shutil.move(built.archive, cached)
        log(f"built {spec.tag} in {time.monotonic() - started:.0f} s")
    OUT.mkdir(parents=True, exist_ok=True)
    shutil.copyfile(cached, target)
    log(f"{target.relative_to(ROOT)}: {oci.ImageArchive.read(target).digest}")
    return target


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m tandem_dev.images.build", description=__doc__.splitlines()[0])
    parser.add_argument("--relock", action="store_true", help="rewrite images/tandem/debian.lock from the mirror")
    parser.add_argument("--force", action="store_true", help="rebuild even when the cache has these inputs")
    args = parser.parse_args(argv)
    spec = ImageSpec()
    cached = cached_archive(spec).exists() and not (args.relock or args.force)
    started = time.monotonic()
    try:
        target = build(spec, do_relock=args.relock, force=args.force)
    except BuildError as e:
        print(f"make images: {e}", file=sys.stderr)
        return 2
    figures = {
        "seconds": round(time.monotonic() - started, 1),
        "cached": cached,
        "archive_bytes": target.stat().st_size,
    }
    argv_run = ["python", "-m", "tandem_dev.images.build", *(sys.argv[1:] if argv is None else argv)]
    log(f"build time saved to {records.save('images-build', figures, argv_run, ROOT / records.RECORDS)}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
