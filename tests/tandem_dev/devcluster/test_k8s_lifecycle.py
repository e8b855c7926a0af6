"""A failed start leaves nothing behind: every component already started is stopped, logs stay for the report."""

from __future__ import annotations

import asyncio
from pathlib import Path

import pytest

from tandem_dev.devcluster.cluster import ClusterStartError, DevCluster
from tandem_dev.devcluster.config import BINARIES, DevClusterConfig, default_bin_dir, require_binaries

pytestmark = [pytest.mark.k8s, pytest.mark.timeout(240)]


def processes_mentioning(text: str) -> list[int]:
    """Pids whose command line contains ``text`` (every component's argv names the cluster directory)."""
    pids = []
    for cmdline in Path("/proc").glob("[0-9]*/cmdline"):
        try:
            if text.encode() in cmdline.read_bytes():
                pids.append(int(cmdline.parent.name))
        except OSError:
            continue
    return pids


async def test_failed_start_stops_every_started_component(tmp_path: Path) -> None:
    real = require_binaries(default_bin_dir())
    bin_dir = tmp_path / "bin"
    bin_dir.mkdir()
    for name in BINARIES:
        (bin_dir / name).symlink_to(real[name])
    broken_kwok = bin_dir / "kwok"
    broken_kwok.unlink()
    broken_kwok.write_text("#!/bin/sh\necho 'kwok: refusing to start (test)' >&2\nexit 3\n")
    broken_kwok.chmod(0o755)
    root = tmp_path / "cluster"
    cluster = DevCluster(root, DevClusterConfig(nodes=1), bin_dir=bin_dir)

    with pytest.raises(ClusterStartError, match=r"(?s)kwok exited \(3\).*refusing to start"):
        await asyncio.to_thread(cluster.start)

    assert cluster.processes == []
    assert processes_mentioning(str(root)) == []
    logs = sorted(path.name for path in (root / "logs").iterdir())
    assert logs == ["etcd.log", "kube-apiserver.log", "kube-controller-manager.log", "kube-scheduler.log", "kwok.log"]
