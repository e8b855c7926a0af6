"""The image build's pure parts: the OCI writer is deterministic and readable, the generated Dockerfile says
what the built image's config says, and a missing host tool is named."""

from __future__ import annotations

import json
import os
import shlex
from pathlib import Path

import pytest

from tandem_dev.images import build, dockerfile, oci
from tandem_dev.images.spec import DOCKERFILE, ImageSpec, read_debian_lock


def _tree(root: Path) -> Path:
    (root / "etc").mkdir(parents=True)
    (root / "etc" / "hello").write_text("hi\n")
    os.link(root / "etc" / "hello", root / "etc" / "hardlink")
    (root / "bin").symlink_to("usr/bin")
    return root


def test_the_archive_digest_depends_only_on_content_and_round_trips(tmp_path: Path) -> None:
    tree = _tree(tmp_path / "a")
    config = build.image_config(ImageSpec())
    first = oci.write_archive(tmp_path / "1.tar", oci.layer_tar(tree, 1_700_000_000), config, "t:1", 1_700_000_000)
    os.utime(tree / "etc" / "hello", (2_000_000_000, 2_000_000_000))  # newer than the epoch: clamped
    second = oci.write_archive(tmp_path / "2.tar", oci.layer_tar(tree, 1_700_000_000), config, "t:1", 1_700_000_000)
    assert first.digest == second.digest
    assert (tmp_path / "1.tar").read_bytes() == (tmp_path / "2.tar").read_bytes()

    image = oci.ImageArchive.read(tmp_path / "1.tar")
    assert image.digest == first.digest
    assert image.config["config"] == config
    assert image.config["created"] == "2023-11-14T22:13:20Z"


def test_a_corrupted_blob_is_refused(tmp_path: Path) -> None:
    tree = _tree(tmp_path / "a")
    built = oci.write_archive(tmp_path / "1.tar", oci.layer_tar(tree, 1), {}, "t:1", 1)
    data = bytearray(built.archive.read_bytes())
    config_at = data.find(b'"architecture"')
    data[config_at + 1] ^= 0x01
    built.archive.write_bytes(bytes(data))
    with pytest.raises(ValueError, match="does not match its digest"):
        oci.ImageArchive.read(built.archive)


def test_the_committed_dockerfile_is_the_rendered_spec() -> None:
    assert DOCKERFILE.read_text() == dockerfile.render(ImageSpec(), read_debian_lock()), "run `make generate`"


def _final_stage(text: str) -> dict[str, list[str]]:
    lines = text.replace("\\\n", " ").splitlines()
    stage = lines[max(i for i, line in enumerate(lines) if line.startswith("FROM ")) :]
    out: dict[str, list[str]] = {}
    for line in stage:
        word, _, rest = line.partition(" ")
        out.setdefault(word, []).append(rest.strip())
    return out


def test_the_dockerfile_configures_what_the_image_config_says() -> None:
    """User, entrypoint, cmd, env, workdir, ports and labels of the Dockerfile's final stage, read back."""
    cfg = build.image_config(ImageSpec())
    stage = _final_stage(DOCKERFILE.read_text())
    assert stage["USER"] == [cfg["User"]]
    assert json.loads(stage["ENTRYPOINT"][0]) == cfg["Entrypoint"]
    assert json.loads(stage["CMD"][0]) == cfg["Cmd"]
    assert stage["WORKDIR"] == [cfg["WorkingDir"]]
    assert [f"{p}/tcp" for p in stage["EXPOSE"]] == list(cfg["ExposedPorts"])  # type: ignore[call-overload]
    assert shlex.split(stage["ENV"][0]) == cfg["Env"]
    assert dict(kv.split("=", 1) for kv in shlex.split(stage["LABEL"][0])) == cfg["Labels"]


def test_a_missing_host_tool_is_named(monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> None:
    monkeypatch.setenv("PATH", str(tmp_path))
    with pytest.raises(build.BuildError, match=r"debootstrap \(Debian package debootstrap\).*bootstrap.sh --images"):
        build.check_host()
