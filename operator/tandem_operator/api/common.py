"""Kubernetes value types shared by the PDCluster and PDPool models (a small, typed subset of core/v1)."""

from __future__ import annotations

from enum import StrEnum
from typing import Annotated, Any, Literal

from pydantic import Field, StringConstraints, WithJsonSchema

from tandem_operator.api.rules import CrdModel, Rule

GROUP = "tandem.dev"
VERSION = "v1alpha1"
API_VERSION = f"{GROUP}/{VERSION}"

# A resource.Quantity ("8", "64Gi", 500m) or a plain integer: stored as the API server received it.
Quantity = Annotated[
    int | Annotated[str, StringConstraints(pattern=r"^[0-9]+(\.[0-9]+)?(m|k|M|G|T|P|E|Ki|Mi|Gi|Ti|Pi|Ei)?$")],
    WithJsonSchema({"x-kubernetes-int-or-string": True}),
]
LabelKey = Annotated[str, StringConstraints(min_length=1, max_length=317)]
LabelValue = Annotated[str, StringConstraints(max_length=63)]
Port = Annotated[int, Field(ge=1, le=65535)]
# Conditions merge by type under server-side apply, like metav1.Condition lists in built-in types.
CONDITIONS_LIST: dict[str, Any] = {"x-kubernetes-list-type": "map", "x-kubernetes-list-map-keys": ["type"]}


class ConditionStatus(StrEnum):
    TRUE = "True"
    FALSE = "False"
    UNKNOWN = "Unknown"


class Toleration(CrdModel):
    """core/v1 Toleration."""

    key: LabelKey | None = None
    operator: Literal["Exists", "Equal"] = "Equal"
    value: LabelValue | None = None
    effect: Literal["NoSchedule", "PreferNoSchedule", "NoExecute"] | None = None
    toleration_seconds: int | None = Field(default=None, ge=0)


class EnvVar(CrdModel):
    """A literal environment variable for the SGLang container."""

    name: Annotated[str, StringConstraints(pattern=r"^[-._a-zA-Z][-._a-zA-Z0-9]*$", max_length=256)]
    value: Annotated[str, StringConstraints(max_length=4096)] = ""


class Resources(CrdModel):
    """Extra container resources (CPU, memory, RDMA devices); GPUs come from gpusPerNode."""

    requests: dict[str, Quantity] = Field(default_factory=dict, max_length=16)
    limits: dict[str, Quantity] = Field(default_factory=dict, max_length=16)


class PortSet(CrdModel):
    """The fixed ports of one role's pods. With hostNetwork they are node ports, so roles must not share any."""

    http: Port = Field(description="SGLang HTTP server (--port).")
    bootstrap: Port = Field(description="PD bootstrap server (--disaggregation-bootstrap-port, prefill leaders).")
    dist_init: Port = Field(description="torch.distributed rendezvous on the group leader (--dist-init-addr).")
    mooncake_rpc: Port = Field(
        description="First port of the Mooncake transfer engine's declared range [mooncakeRpc, mooncakeRpc + "
        "mooncakePorts). A pod gets one window of it (MC_MIN_RPC_PORT..MC_MAX_RPC_PORT): one port per engine with "
        "protocol rdma, two with tcp (Mooncake's TCP transport takes its data port from the same range)."
    )
    mooncake_ports: int = Field(
        default=64,
        ge=1,
        le=4096,
        description="Size of the declared Mooncake range. Each recreation of a group (epoch) moves its pods to the "
        "next window of the range, so peers never meet a new incarnation under a session id 'ip:port' they still "
        "hold for the dead one; a range of one window reuses the session ids. The default leaves room for several "
        "windows of an 8-GPU pod (one port per rank with rdma, two with tcp).",
    )

    cel_rules = (
        Rule(
            cel="[self.http, self.bootstrap, self.distInit].all(p, "
            "[self.http, self.bootstrap, self.distInit].filter(q, q == p).size() == 1 && "
            "(p < self.mooncakeRpc || p >= self.mooncakeRpc + self.mooncakePorts))",
            message="ports must be pairwise different and outside the Mooncake range "
            "[mooncakeRpc, mooncakeRpc + mooncakePorts)",
            check=lambda s: len(set(s.all())) == 3 + s.mooncake_ports,
        ),
        Rule(
            cel="self.mooncakeRpc >= 1024 && self.mooncakeRpc + self.mooncakePorts <= 65536 && "
            "(self.mooncakeRpc + self.mooncakePorts <= 32768 || self.mooncakeRpc > 60999)",
            message="the Mooncake range [mooncakeRpc, mooncakeRpc + mooncakePorts) must lie within 1024-32767 or "
            "61000-65535 (Mooncake ignores a range that touches the ephemeral ports 32768-60999 and falls back to "
            "15000-17000)",
            check=lambda s: (
                s.mooncake_rpc >= 1024
                and s.mooncake_rpc + s.mooncake_ports <= 65536
                and (s.mooncake_rpc + s.mooncake_ports <= 32768 or s.mooncake_rpc > 60999)
            ),
            field_path=".mooncakePorts",
        ),
    )

    def all(self) -> tuple[int, ...]:
        """Every port a pod of the role may listen on, the whole Mooncake range included."""
        mooncake = range(self.mooncake_rpc, self.mooncake_rpc + self.mooncake_ports)
        return (self.http, self.bootstrap, self.dist_init, *mooncake)


class Condition(CrdModel):
    """A metav1.Condition."""

    type: str
    status: ConditionStatus
    reason: str = Field(pattern=r"^[A-Za-z]([A-Za-z0-9_,:]*[A-Za-z0-9_])?$", max_length=1024)
    message: str = Field(default="", max_length=32768)
    last_transition_time: str = Field(description="RFC 3339 time the status last changed.")
    observed_generation: int | None = Field(default=None, ge=0)
