"""The one description of the ``tandem`` image, used by both builds.

``make images`` (tandem_dev.images.build: debootstrap + chroot) and ``images/tandem/Dockerfile`` (rendered from this
module by ``make generate``) run the same shell commands on the same base, with the same user, entrypoint, env,
labels and Python package set, so the image a Docker user builds is the image that was tested here.
"""

from __future__ import annotations

import tomllib
from dataclasses import dataclass, field
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
DEBIAN_LOCK = ROOT / "images" / "tandem" / "debian.lock"
DOCKERFILE = ROOT / "images" / "tandem" / "Dockerfile"
PIP_VERSION = "25.3"
WHEELS_DIR = "/wheels"  # where the build puts the pinned wheels (removed again in the same step)
VENV = "/opt/tandem"
UID = 65532


def project_version() -> str:
    """The version in pyproject.toml, which is also the image tag."""
    with (ROOT / "pyproject.toml").open("rb") as f:
        return str(tomllib.load(f)["project"]["version"])


@dataclass(frozen=True)
class ImageSpec:
    """What goes into the image and how it is configured (OCI image config fields)."""

    name: str = "tandem"
    suite: str = "bookworm"
    # Debian packages on top of the minbase system (their dependencies are pinned in images/tandem/debian.lock).
    packages: tuple[str, ...] = ("python3.11",)
    entrypoint: tuple[str, ...] = ("tandem",)
    cmd: tuple[str, ...] = ("router", "--help")
    user: str = f"{UID}:{UID}"
    workdir: str = "/"
    exposed_ports: tuple[str, ...] = ("8000/tcp",)
    env: tuple[tuple[str, str], ...] = (
        ("PATH", f"{VENV}/bin:/usr/local/sbin:/usr/local/bin:/usr/sbin:/usr/bin:/sbin:/bin"),
        ("LANG", "C.UTF-8"),
        ("PYTHONUNBUFFERED", "1"),
    )
    labels: tuple[tuple[str, str], ...] = field(
        default_factory=lambda: (
            ("org.opencontainers.image.title", "tandem"),
            ("org.opencontainers.image.description", "Tandem PD router and operator"),
            ("org.opencontainers.image.licenses", "Apache-2.0"),
            ("org.opencontainers.image.version", project_version()),
        )
    )

    @property
    def tag(self) -> str:
        return f"{self.name}:{project_version()}"


def apt_install_command(pins: dict[str, str]) -> str:
    """Installs the pinned Debian packages (the image's packages and their dependencies), then drops apt's state."""
    wanted = " ".join(f"{name}={version}" for name, version in sorted(pins.items()))
    return (
        "apt-get update"
        f" && DEBIAN_FRONTEND=noninteractive apt-get install -y --no-install-recommends {wanted}"
        " && apt-get clean && rm -rf /var/lib/apt/lists/* /var/log/apt /var/log/dpkg.log /var/cache/debconf/*-old"
        " /var/lib/dpkg/*-old"
    )


def install_commands() -> tuple[str, ...]:
    """The commands run in the image after its Debian packages: venv, pinned wheels (offline), user."""
    pip = f"{VENV}/bin/python {WHEELS_DIR}/pip-{PIP_VERSION}-py3-none-any.whl/pip"
    return (
        f"python3.11 -m venv --without-pip {VENV}",
        f"{pip} install --disable-pip-version-check --no-cache-dir --no-index --find-links {WHEELS_DIR}"
        f" -c {WHEELS_DIR}/constraints.txt tandem",
        f"rm -rf {WHEELS_DIR}",
        f"groupadd --gid {UID} tandem",
        f"useradd --uid {UID} --gid {UID} --no-create-home --home-dir /nonexistent --shell /usr/sbin/nologin tandem",
        "rm -f /etc/passwd- /etc/group- /etc/shadow- /etc/gshadow- /var/log/lastlog /var/log/faillog",
    )


def read_debian_lock(path: Path = DEBIAN_LOCK) -> dict[str, str]:
    """``package=version`` lines (``#`` comments allowed): the Debian packages installed on top of minbase."""
    pins: dict[str, str] = {}
    for raw in path.read_text().splitlines():
        line = raw.split("#", 1)[0].strip()
        if line:
            name, _, version = line.partition("=")
            pins[name] = version
    return pins
