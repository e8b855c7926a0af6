"""A deterministic OCI image writer and reader (image-spec v1.1, one layer), in the standard library only.

The image digest is a function of the files and the config alone: tar entries are sorted, owners are numeric,
mtimes are clamped to SOURCE_DATE_EPOCH, gzip carries no name or time, and ``created`` is SOURCE_DATE_EPOCH.
"""

from __future__ import annotations

import gzip
import hashlib
import io
import json
import os
import stat
import tarfile
from collections.abc import Iterator
from dataclasses import dataclass
from datetime import UTC, datetime
from pathlib import Path
from typing import Any

MEDIA_MANIFEST = "application/vnd.oci.image.manifest.v1+json"
MEDIA_CONFIG = "application/vnd.oci.image.config.v1+json"
MEDIA_LAYER = "application/vnd.oci.image.layer.v1.tar+gzip"


def _walk(root: Path) -> Iterator[Path]:
    """Every path under root (not root itself), sorted, directories before their contents."""
    for entry in sorted(os.scandir(root), key=lambda e: e.name):
        path = Path(entry.path)
        yield path
        if entry.is_dir(follow_symlinks=False):
            yield from _walk(path)


def layer_tar(rootfs: Path, epoch: int) -> bytes:
    """The root filesystem as an uncompressed, reproducible tar (hard links kept, devices and sockets refused)."""
    buf = io.BytesIO()
    seen: dict[tuple[int, int], str] = {}
    with tarfile.open(fileobj=buf, mode="w", format=tarfile.PAX_FORMAT) as tar:
        for path in _walk(rootfs):
            st = path.lstat()
            name = path.relative_to(rootfs).as_posix()
            info = tarfile.TarInfo(name)
            info.mode = stat.S_IMODE(st.st_mode)
            info.uid, info.gid, info.uname, info.gname = st.st_uid, st.st_gid, "", ""
            info.mtime = min(int(st.st_mtime), epoch)
            if stat.S_ISDIR(st.st_mode):
                info.type = tarfile.DIRTYPE
                tar.addfile(info)
            elif stat.S_ISLNK(st.st_mode):
                info.type, info.linkname = tarfile.SYMTYPE, os.readlink(path)
                tar.addfile(info)
            elif stat.S_ISREG(st.st_mode):
                key = (st.st_dev, st.st_ino)
                if st.st_nlink > 1 and key in seen:
                    info.type, info.linkname = tarfile.LNKTYPE, seen[key]
                    tar.addfile(info)
                    continue
                seen[key] = name
                info.size = st.st_size
                with path.open("rb") as f:
                    tar.addfile(info, f)
            else:
                raise ValueError(f"{name}: not a file, directory or symlink; an image layer cannot carry it")
    return buf.getvalue()


def _blob(data: bytes) -> tuple[str, bytes]:
    return "sha256:" + hashlib.sha256(data).hexdigest(), data


def _json(doc: dict[str, Any]) -> bytes:
    return json.dumps(doc, sort_keys=True, separators=(",", ":")).encode()


@dataclass(frozen=True)
class BuiltImage:
    """What was written: the archive, the manifest digest (the image's identity) and the layer's sizes."""

    archive: Path
    digest: str
    layer_digest: str
    diff_id: str
    layer_bytes: int
    uncompressed_bytes: int


def write_archive(archive: Path, layer: bytes, config: dict[str, Any], ref: str, epoch: int) -> BuiltImage:
    """Writes an OCI image layout as a tar (``oci-archive:`` for skopeo/podman, ``umoci unpack`` after untar)."""
    diff_id = "sha256:" + hashlib.sha256(layer).hexdigest()
    gz = io.BytesIO()
    with gzip.GzipFile(fileobj=gz, mode="wb", mtime=0, compresslevel=6, filename="") as f:
        f.write(layer)
    layer_digest, layer_gz = _blob(gz.getvalue())
    created = f"{datetime.fromtimestamp(epoch, tz=UTC):%Y-%m-%dT%H:%M:%SZ}"
    image_config = {
        "architecture": "amd64",
        "os": "linux",
        "created": created,
        "config": config,
        "rootfs": {"type": "layers", "diff_ids": [diff_id]},
        "history": [{"created": created, "created_by": "tandem_dev.images.build (debootstrap + chroot)"}],
    }
    config_digest, config_bytes = _blob(_json(image_config))
    manifest = {
        "schemaVersion": 2,
        "mediaType": MEDIA_MANIFEST,
        "config": {"mediaType": MEDIA_CONFIG, "digest": config_digest, "size": len(config_bytes)},
        "layers": [{"mediaType": MEDIA_LAYER, "digest": layer_digest, "size": len(layer_gz)}],
    }
    manifest_digest, manifest_bytes = _blob(_json(manifest))
    index = {
        "schemaVersion": 2,
        "manifests": [
            {
                "mediaType": MEDIA_MANIFEST,
                "digest": manifest_digest,
                "size": len(manifest_bytes),
                "annotations": {"org.opencontainers.image.ref.name": ref},
            }
        ],
    }
    files = {
        "oci-layout": _json({"imageLayoutVersion": "1.0.0"}),
        "index.json": _json(index),
        **{
            f"blobs/sha256/{d.split(':', 1)[1]}": b
            for d, b in ((config_digest, config_bytes), (layer_digest, layer_gz), (manifest_digest, manifest_bytes))
        },
    }
    archive.parent.mkdir(parents=True, exist_ok=True)
    tmp = archive.with_suffix(".tmp")
    with tarfile.open(tmp, "w", format=tarfile.PAX_FORMAT) as tar:
        for directory in ("blobs", "blobs/sha256"):
            info = tarfile.TarInfo(directory)
            info.type, info.mode, info.mtime = tarfile.DIRTYPE, 0o755, epoch
            tar.addfile(info)
        for name in sorted(files):
            info = tarfile.TarInfo(name)
            info.size, info.mode, info.mtime = len(files[name]), 0o644, epoch
            tar.addfile(info, io.BytesIO(files[name]))
    tmp.replace(archive)
    return BuiltImage(archive, manifest_digest, layer_digest, diff_id, len(layer_gz), len(layer))


@dataclass(frozen=True)
class ImageArchive:
    """An OCI archive read back: its manifest digest, image config and layer blobs (digests verified)."""

    digest: str
    config: dict[str, Any]
    layers: list[bytes]

    @classmethod
    def read(cls, archive: Path) -> ImageArchive:
        with tarfile.open(archive) as tar:

            def blob(digest: str) -> bytes:
                member = tar.extractfile(f"blobs/sha256/{digest.split(':', 1)[1]}")
                assert member is not None
                data = member.read()
                if "sha256:" + hashlib.sha256(data).hexdigest() != digest:
                    raise ValueError(f"{archive}: blob {digest} does not match its digest")
                return data

            index_file = tar.extractfile("index.json")
            assert index_file is not None
            (entry,) = json.load(index_file)["manifests"]
            manifest = json.loads(blob(entry["digest"]))
            config = json.loads(blob(manifest["config"]["digest"]))
            layers = [blob(layer["digest"]) for layer in manifest["layers"]]
        return cls(entry["digest"], config, layers)

    def unpack(self, rootfs: Path) -> None:
        """Extracts the layers into rootfs, keeping owners and modes (needs root, as every image unpacker)."""
        rootfs.mkdir(parents=True, exist_ok=True)
        for layer in self.layers:
            with tarfile.open(fileobj=io.BytesIO(gzip.decompress(layer))) as tar:
                tar.extractall(rootfs, filter="fully_trusted", numeric_owner=True)  # digests verified: our own image
