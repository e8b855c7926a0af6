"""``PDCluster.spec.transfer``: how KV moves from prefill to decode (Mooncake), and the interfaces collectives use."""

from __future__ import annotations

from enum import StrEnum
from typing import Annotated

from pydantic import Field, StringConstraints

from tandem_operator.api.rules import CrdModel, Rule

IbDevice = Annotated[str, StringConstraints(pattern=r"^[A-Za-z0-9_.-]+$", max_length=64)]


class TransferProtocol(StrEnum):
    RDMA = "rdma"
    TCP = "tcp"


class TransferSpec(CrdModel):
    """How KV moves from prefill to decode (Mooncake transfer engine)."""

    protocol: TransferProtocol = TransferProtocol.RDMA
    ib_devices: list[IbDevice] = Field(
        default_factory=list,
        max_length=16,
        description="RDMA devices for Mooncake (--disaggregation-ib-device), NCCL_IB_HCA and NVSHMEM_HCA_LIST, e.g. "
        "[mlx5_0, mlx5_1]. Empty with protocol rdma: the worker uses every device in /sys/class/infiniband with an "
        "ACTIVE port, found at start (name them when storage or front-end NICs are RDMA devices too). Only for "
        "protocol rdma.",
    )
    rdma_resource: str | None = Field(
        default=None,
        max_length=253,
        description="Extended resource of an RDMA device plugin (e.g. rdma/hca_shared_devices_a); requested once "
        "per pod instead of mounting the host's /dev/infiniband.",
    )
    host_network: bool = Field(default=False, description="Run workers in the node's network namespace.")
    metadata_refresh_seconds: int = Field(
        default=2,
        ge=1,
        le=300,
        description="MC_TE_METADATA_REFRESH_INTERVAL_SECONDS: how often every engine re-reads the descriptors of the "
        "peers it cached (Mooncake's default, 0, never does): a peer that came back under the same session id with "
        "another TCP data port or other buffers is reached again within this time.",
    )
    disable_metadata_cache: bool = Field(default=False, description="MC_DISABLE_METACACHE.")
    failed_session_probe_seconds: int = Field(
        default=1,
        ge=1,
        le=300,
        description="SGLANG_FAILED_SESSION_PROBE_INTERVAL_S (SGLang's default: 30): how soon a prefill probes a decode "
        "session it blacklisted after a failed send, and un-blacklists it when the probe succeeds.",
    )
    failed_session_probe_max_seconds: int = Field(
        default=4,
        ge=1,
        le=3600,
        description="SGLANG_FAILED_SESSION_PROBE_MAX_INTERVAL_S (SGLang's default: 300): the probe interval doubles "
        "per failed probe up to this.",
    )
    socket_interface: str | None = Field(
        default=None,
        pattern=r"^[A-Za-z0-9_.^,-]+$",
        max_length=64,
        description="NCCL_SOCKET_IFNAME and GLOO_SOCKET_IFNAME (bootstrap and CPU collectives), e.g. bond0. Unset: "
        "the worker uses the interface that holds the pod's IP (with hostNetwork the node's), found at start. Set: "
        "a named interface missing on the node fails the pod at start. NCCL's `^` (exclude) and `=` (exact) forms "
        "go to NCCL only; Gloo then gets the interface found.",
    )
    ib_gid_index: int | None = Field(
        default=None, ge=0, le=255, description="NCCL_IB_GID_INDEX and NVSHMEM_IB_GID_INDEX (RoCE: usually 3)."
    )

    cel_rules = (
        Rule(
            cel="self.failedSessionProbeSeconds <= self.failedSessionProbeMaxSeconds",
            message="failedSessionProbeSeconds must not exceed failedSessionProbeMaxSeconds",
            check=lambda s: s.failed_session_probe_seconds <= s.failed_session_probe_max_seconds,
            field_path=".failedSessionProbeSeconds",
        ),
        Rule(
            cel="self.protocol == 'rdma' || !has(self.ibDevices) || self.ibDevices.size() == 0",
            message="ibDevices needs protocol rdma (tcp uses no RDMA device); with rdma, leave ibDevices empty to "
            "use every device with an ACTIVE port",
            check=lambda s: s.protocol == TransferProtocol.RDMA or not s.ib_devices,
            field_path=".ibDevices",
        ),
    )
