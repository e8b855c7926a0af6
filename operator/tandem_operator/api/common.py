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
    bootstrap: Port = Field(
        description="First port of the prefill leaders' PD bootstrap range (--disaggregation-bootstrap-port); a "
        "decode pod never binds it."
    )
    bootstrap_ports: int = Field(
        default=8,
        ge=1,
        le=64,
        description="Size of the bootstrap range [bootstrap, bootstrap + bootstrapPorts). Each recreation (epoch) of "
        "a prefill group moves its bootstrap server to the next port of the range, wrapping around: SGLang's decode "
        "caches a bootstrap address's rank ports until two heartbeats to it fail, and a recreated prefill's bootstrap "
        "server answers them seconds after it starts (before its weights load), so under the old address decodes "
        "would keep sending to the dead incarnation. A range of one port reuses the address.",
    )
    dist_init: Port = Field(description="torch.distributed rendezvous on the group leader (--dist-init-addr).")
    mooncake_rpc: Port = Field(
        description="First port of the role's Mooncake range; a pod gets one window of it as [MC_MIN_RPC_PORT, "
        "MC_MAX_RPC_PORT]. Every GPU rank runs "
        "its own Mooncake transfer engine, which takes its RPC port (the session id 'ip:port') from the range, and "
        "with protocol tcp also its TCP data port: the range is gpusPerNode ports for rdma, 2 x gpusPerNode for tcp. "
        "It must lie within 1024-32767 or 61000-65535 (Mooncake silently ignores a range that touches the "
        "ephemeral ports)."
    )
    mooncake_ports: int = Field(
        default=64,
        ge=1,
        le=4096,
        description="Size of the role's declared Mooncake range [mooncakeRpc, mooncakeRpc + mooncakePorts), at least "
        "one pod window (gpusPerNode ports for rdma, 2 x gpusPerNode for tcp). Each recreation of a group (epoch) "
        "moves its pods to the next window of the range, so peers never meet a new incarnation under a session id "
        "'ip:port' they still hold for the dead one; a range of one window reuses the session ids.",
    )

    cel_rules = (
        Rule(
            cel="[self.http, self.bootstrap, self.distInit, self.mooncakeRpc].all(p, "
            "[self.http, self.bootstrap, self.distInit, self.mooncakeRpc].filter(q, q == p).size() == 1)",
            message="ports must be pairwise different",
            check=lambda s: len({s.http, s.bootstrap, s.dist_init, s.mooncake_rpc}) == 4,
        ),
        Rule(
            cel="[self.http, self.distInit, self.mooncakeRpc].all(p, "
            "p < self.bootstrap || p >= self.bootstrap + self.bootstrapPorts)",
            message="http, distInit and mooncakeRpc must lie outside the bootstrap range "
            "[bootstrap, bootstrap + bootstrapPorts - 1]",
            check=lambda s: not {s.http, s.dist_init, s.mooncake_rpc} & set(s.bootstrap_range()),
        ),
    )

    def bootstrap_range(self) -> range:
        """Every port the prefill leader's bootstrap server may take, whatever its epoch."""
        return range(self.bootstrap, self.bootstrap + self.bootstrap_ports)

    def bootstrap_at(self, epoch: int) -> int:
        """The bootstrap port of incarnation ``epoch``: the range's ports in turn, wrapping around.

        SGLang's decode keeps a bootstrap address's rank ports in ``CommonKVReceiver``'s class-level
        ``connection_pool`` (keyed by ``bootstrap_addr``, ``sglang/srt/disaggregation/common/conn.py``) and drops them
        only after two failed ``/health`` heartbeats (``_start_heartbeat_checker_thread`` -> ``_handle_node_failure``,
        ``SGLANG_DISAGGREGATION_HEARTBEAT_INTERVAL`` 5 s). A new incarnation on a new port is a new key, so decodes
        fetch its rank ports afresh; the dead one's entry ages out by its failed heartbeats.
        """
        return self.bootstrap + epoch % self.bootstrap_ports

    def fixed(self) -> tuple[int, ...]:
        """The pod's ports outside its Mooncake range (the whole bootstrap range)."""
        return (self.http, *self.bootstrap_range(), self.dist_init)


class Condition(CrdModel):
    """A metav1.Condition."""

    type: str
    status: ConditionStatus
    reason: str = Field(pattern=r"^[A-Za-z]([A-Za-z0-9_,:]*[A-Za-z0-9_])?$", max_length=1024)
    message: str = Field(default="", max_length=32768)
    last_transition_time: str = Field(description="RFC 3339 time the status last changed.")
    observed_generation: int | None = Field(default=None, ge=0)
