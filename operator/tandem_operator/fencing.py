"""Which group to fence, given one pod or node event, and which stale Mooncake keys to remove. Pure.

Fencing is the first, event-driven step of recovery: the group's registry key is deleted so routers stop sending
it requests, before anything slower (Events, pod deletions, the reconcile) happens. A pod event fences its group
when the pod is dead (``status.pod_health``: deleted, terminating, Failed, a container restarted, on a lost node)
or when it turned NotReady while its group was registered (serving). Groups the operator itself is retiring
(scale-down, rollout) are not fenced: the reconcile unregisters them before deleting their pods, and their end
is not a recovery.

Mooncake writes ``mooncake/[<cluster_id>/]rpc_meta/<server>`` and ``.../ram/<segment>`` without a lease, where the
server / segment name is the ``local_hostname`` given to ``TransferEngine.initialize``: the pod IP, or
``<ip>:<port>`` (measured with mooncake-transfer-engine 0.3.13). A restarted peer of the same name is unreachable
while the stale entries stay cached, so every member's entries are removed when its group is fenced.
"""

from __future__ import annotations

from collections.abc import Collection, Iterable, Mapping
from dataclasses import dataclass
from enum import StrEnum
from typing import Any

from tandem.registry import Role
from tandem_operator.api.mooncake_ports import MAX_PORTS_PER_POD
from tandem_operator.desired.naming import (
    ANNOTATION_EPOCH,
    LABEL_CLUSTER,
    LABEL_GROUP,
    LABEL_RANK,
    LABEL_ROLE,
)
from tandem_operator.status import PodHealth, pod_health

Pod = Mapping[str, Any]
MOONCAKE_ROOT = "mooncake/"
MAX_NAMED_PORTS = MAX_PORTS_PER_POD  # a hostNetwork pod's Mooncake names are cleaned one port at a time


class FenceReason(StrEnum):
    POD_DELETED = "PodDeleted"
    POD_TERMINATING = "PodTerminating"
    POD_FAILED = "PodFailed"
    CONTAINER_RESTARTED = "ContainerRestarted"
    NODE_LOST = "NodeLost"
    POD_NOT_READY = "PodNotReady"
    INTEGRITY_REPEAT_OFFENDER = "IntegrityRepeatOffender"  # routers keep quarantining its pairs (not a pod event)


@dataclass(frozen=True, order=True)
class GroupKey:
    role: Role
    index: int

    @property
    def name(self) -> str:
        """The group's name in the registry (``Endpoint.group``)."""
        return f"{self.role.value}-{self.index}"


@dataclass(frozen=True)
class PodFacts:
    """What recovery needs to know about one worker pod."""

    name: str
    namespace: str
    cluster: str
    group: GroupKey
    rank: int
    epoch: int
    ip: str | None
    node: str | None
    env: Mapping[str, str]  # literal env values of the worker container
    host_network: bool = False

    @property
    def mooncake_ports(self) -> tuple[int, ...]:
        """Mooncake's port range (MC_MIN_RPC_PORT..MC_MAX_RPC_PORT) when it is small enough to name each port."""
        low, high = self.env.get("MC_MIN_RPC_PORT", ""), self.env.get("MC_MAX_RPC_PORT", "")
        if not (low.isdigit() and high.isdigit()) or not 0 <= int(high) - int(low) < MAX_NAMED_PORTS:
            return ()
        return tuple(range(int(low), int(high) + 1))

    @property
    def mooncake_rpc_port(self) -> int | None:
        """The fixed Mooncake RPC port (MC_MIN_RPC_PORT == MC_MAX_RPC_PORT), if the pod has one."""
        ports = self.mooncake_ports
        return ports[0] if len(ports) == 1 else None


@dataclass(frozen=True)
class Fence:
    group: GroupKey
    epoch: int
    reason: FenceReason
    pod: str


def _int(value: object, default: int = 0) -> int:
    return int(value) if isinstance(value, str) and value.isdigit() else default


def pod_facts(pod: Pod) -> PodFacts | None:
    """The facts of a Tandem worker pod, or None for any other pod (missing or malformed labels)."""
    metadata = pod.get("metadata") or {}
    labels = metadata.get("labels") or {}
    try:
        role = Role(labels.get(LABEL_ROLE, ""))
    except ValueError:
        return None
    if not labels.get(LABEL_CLUSTER) or not str(labels.get(LABEL_GROUP, "")).isdigit():
        return None
    if not str(labels.get(LABEL_RANK, "")).isdigit():
        return None
    spec, status = pod.get("spec") or {}, pod.get("status") or {}
    containers = spec.get("containers") or [{}]
    env = {e["name"]: e["value"] for e in containers[0].get("env") or () if "name" in e and "value" in e}
    return PodFacts(
        name=metadata.get("name", ""),
        namespace=metadata.get("namespace", ""),
        cluster=labels[LABEL_CLUSTER],
        group=GroupKey(role, int(labels[LABEL_GROUP])),
        rank=int(labels[LABEL_RANK]),
        epoch=_int((metadata.get("annotations") or {}).get(ANNOTATION_EPOCH)),
        ip=status.get("podIP") or None,
        node=spec.get("nodeName") or None,
        env=env,
        host_network=bool(spec.get("hostNetwork")),
    )


def _is_ready(pod: Pod) -> bool:
    conditions = (pod.get("status") or {}).get("conditions") or ()
    return any(c.get("type") == "Ready" and c.get("status") == "True" for c in conditions)


def death_reason(event_type: str, pod: Pod, lost_nodes: Collection[str], serving: bool) -> FenceReason | None:
    """Why this pod can no longer serve, or None if it can (or has not started serving yet)."""
    if event_type == "DELETED":
        return FenceReason.POD_DELETED
    metadata, status = pod.get("metadata") or {}, pod.get("status") or {}
    if metadata.get("deletionTimestamp"):
        return FenceReason.POD_TERMINATING
    if status.get("phase") in ("Failed", "Succeeded"):
        return FenceReason.POD_FAILED
    if (pod.get("spec") or {}).get("nodeName") in lost_nodes:
        return FenceReason.NODE_LOST
    if pod_health(pod, frozenset(lost_nodes)) is PodHealth.DEAD:
        return FenceReason.CONTAINER_RESTARTED
    if serving and not _is_ready(pod):
        return FenceReason.POD_NOT_READY
    return None


def fence_decision(
    event_type: str,
    pod: Pod,
    *,
    lost_nodes: Collection[str],
    registered: Mapping[GroupKey, int],
    fenced: Mapping[GroupKey, int],
    retiring: Collection[GroupKey],
) -> Fence | None:
    """The fence one pod event calls for.

    ``registered``: group -> epoch of its registry entry; ``fenced``: group -> epoch already fenced (one fence per
    incarnation); ``retiring``: groups the operator is deleting on purpose.
    """
    facts = pod_facts(pod)
    if facts is None or facts.group in retiring:
        return None
    if fenced.get(facts.group) == facts.epoch:
        return None
    serving = registered.get(facts.group) == facts.epoch
    reason = death_reason(event_type, pod, lost_nodes, serving)
    if reason is None:
        return None
    return Fence(facts.group, facts.epoch, reason, facts.name)


def node_lost(event_type: str, node: Mapping[str, Any]) -> bool:
    """A node is lost when deleted or when its Ready condition is not True (kubelet or node controller says so)."""
    if event_type == "DELETED" or (node.get("metadata") or {}).get("deletionTimestamp"):
        return True
    conditions = (node.get("status") or {}).get("conditions") or ()
    ready = next((c for c in conditions if c.get("type") == "Ready"), None)
    return ready is not None and ready.get("status") != "True"


def pods_on_nodes(pods: Iterable[Pod], nodes: Collection[str]) -> list[Pod]:
    return [p for p in pods if (p.get("spec") or {}).get("nodeName") in nodes]


@dataclass(frozen=True)
class StaleKeys:
    """Exact keys and key prefixes (each ending in ':' so 10.0.0.5 never matches 10.0.0.50) to delete."""

    keys: tuple[str, ...]
    prefixes: tuple[str, ...]


def mooncake_prefix(cluster_id: str | None) -> str:
    return f"{MOONCAKE_ROOT}{cluster_id}/" if cluster_id else MOONCAKE_ROOT


def stale_mooncake_keys(members: Iterable[PodFacts], default_cluster_id: str) -> StaleKeys:
    """Every Mooncake metadata entry the members of a dead group may have left, named ``<ip>`` or ``<ip>:<port>``.

    The cluster id is the pod's own ``MC_METADATA_CLUSTER_ID`` (users may override it), else the default. A
    hostNetwork pod shares its IP with every other hostNetwork pod of the node, so only its own ``<ip>:<port>``
    entries (its Mooncake ports) are removed, never the bare IP or a prefix.
    """
    keys: set[str] = set()
    prefixes: set[str] = set()
    for member in members:
        if not member.ip:
            continue
        root = mooncake_prefix(member.env.get("MC_METADATA_CLUSTER_ID", default_cluster_id))
        for kind in ("rpc_meta", "ram"):
            if member.host_network:
                keys.update(f"{root}{kind}/{member.ip}:{port}" for port in member.mooncake_ports)
                continue
            keys.add(f"{root}{kind}/{member.ip}")
            prefixes.add(f"{root}{kind}/{member.ip}:")
    return StaleKeys(tuple(sorted(keys)), tuple(sorted(prefixes)))
