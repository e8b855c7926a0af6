"""Renders images/tandem/Dockerfile from tandem_dev.images.spec (``make generate``; ``make verify`` checks it).

The Dockerfile starts from ``debian:<suite>-slim`` (Docker's minbase build of the same suite) and runs the very
commands ``make images`` runs in its chroot, so both builds give the same user, entrypoint, env, labels, Debian
packages and Python packages.
"""

from __future__ import annotations

import json

from tandem_dev.images.spec import (
    DOCKERFILE,
    PIP_VERSION,
    WHEELS_DIR,
    ImageSpec,
    apt_install_command,
    install_commands,
    read_debian_lock,
)


def _run(command: str) -> str:
    return "RUN " + command.replace(" && ", " \\\n && ")


def render(spec: ImageSpec, pins: dict[str, str]) -> str:
    labels = " \\\n      ".join(f"{k}={json.dumps(v)}" for k, v in spec.labels)
    env = " \\\n    ".join(f"{k}={json.dumps(v)}" for k, v in spec.env)
    return "\n".join(
        [
            "# GENERATED from tandem_dev/images/spec.py by `make generate`: edit that file, not this one.",
            f"# The Tandem control-plane image ({spec.tag}): `tandem operator` and `tandem router`.",
            f"# Build from the repository root:  docker build -f images/tandem/Dockerfile -t {spec.tag} .",
            "# Without Docker, `make images` builds the same image (debootstrap + chroot) as an OCI archive.",
            "FROM python:3.11.14-slim-bookworm AS wheels",
            "WORKDIR /src",
            "COPY pyproject.toml constraints.txt README.md ./",
            "COPY tandem ./tandem",
            "COPY simulator ./simulator",
            "COPY router ./router",
            "COPY operator ./operator",
            f"RUN pip install --no-cache-dir pip=={PIP_VERSION} \\",
            f" && pip wheel --no-cache-dir --wheel-dir {WHEELS_DIR} -c constraints.txt . \\",
            f" && pip download --no-cache-dir --no-deps --only-binary=:all: -d {WHEELS_DIR} pip=={PIP_VERSION} \\",
            f" && cp constraints.txt {WHEELS_DIR}/constraints.txt",
            "",
            f"FROM debian:{spec.suite}-slim",
            f"LABEL {labels}",
            'SHELL ["/bin/sh", "-e", "-c"]',
            _run(apt_install_command(pins)),
            f"COPY --from=wheels {WHEELS_DIR} {WHEELS_DIR}",
            _run(" && ".join(install_commands())),
            f"ENV {env}",
            f"USER {spec.user}",
            f"WORKDIR {spec.workdir}",
            *(f"EXPOSE {port.removesuffix('/tcp')}" for port in spec.exposed_ports),
            f"ENTRYPOINT {json.dumps(list(spec.entrypoint))}",
            f"CMD {json.dumps(list(spec.cmd))}",
            "",
        ]
    )


def main() -> None:
    DOCKERFILE.write_text(render(ImageSpec(), read_debian_lock()))


if __name__ == "__main__":
    main()
