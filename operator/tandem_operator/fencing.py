"""Which group to fence, given one pod or node event, and which stale Mooncake keys to remove. Pure.

Fencing is the first, event-driven step of recovery: the group's registry key is deleted so routers stop sending
it requests, before anything slower (Events, pod deletions, the reconcile) happens. A pod event fences its group
only when the pod is dead (``observe.pod_health``: deleted, terminating, Failed, a container exited or restarted,
on a lost node): only then is the group recreated. A pod that merely turned NotReady while its group was registered
(a busy worker's slow ``/health``) is *unrouted* (``unroute_decision``): its registry entry is removed, nothing
else, and the reconcile registers it again with the same epoch when it is Ready. Groups the operator itself is
retiring (scale-down, rollout) are not fenced: the reconcile unregisters them before deleting their pods, and
their end is not a recovery.

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

from tandem_operator.observe import GroupKey, Pod, PodFacts, PodHealth, is_ready, pod_facts, pod_health

MOONCAKE_ROOT = "mooncake/"


class FenceReason(StrEnum):
    POD_DELETED = "PodDeleted"
    POD_TERMINATING = "PodTerminating"
    POD_FAILED = "PodFailed"
    CONTAINER_RESTARTED = "ContainerRestarted"
    NODE_LOST = "NodeLost"
    START_DEADLINE = "StartDeadlineExceeded"  # Starting/Incomplete past lifecycle.startDeadlineSeconds
    INTEGRITY_REPEAT_OFFENDER = "IntegrityRepeatOffender"  # routers keep quarantining its pairs (not a pod event)


@dataclass(frozen=True)
class Fence:
    group: GroupKey
    epoch: int
    reason: FenceReason
    pod: str


def death_reason(event_type: str, pod: Pod, lost_nodes: Collection[str]) -> FenceReason | None:
    """Why this pod can no longer serve, or None if it is alive (Ready or not)."""
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
    return None


def fence_decision(
    event_type: str,
    pod: Pod,
    *,
    lost_nodes: Collection[str],
    fenced: Mapping[GroupKey, int],
    retiring: Collection[GroupKey],
) -> Fence | None:
    """The fence one pod event calls for.

    ``fenced``: group -> epoch already fenced (one fence per incarnation); ``retiring``: groups the operator is
    deleting on purpose.
    """
    facts = pod_facts(pod)
    if facts is None or facts.group in retiring:
        return None
    if fenced.get(facts.group) == facts.epoch:
        return None
    reason = death_reason(event_type, pod, lost_nodes)
    if reason is None:
        return None
    return Fence(facts.group, facts.epoch, reason, facts.name)


def unroute_decision(
    event_type: str, pod: Pod, *, lost_nodes: Collection[str], registered: Mapping[GroupKey, int]
) -> GroupKey | None:
    """The registered group to take out of rotation because this live member turned NotReady, else None.

    Readiness only gates routing: the group keeps its pods and epoch, and is registered again once Ready.
    """
    facts = pod_facts(pod)
    if facts is None or registered.get(facts.group) != facts.epoch:
        return None  # not serving at this incarnation (still starting, or an older one)
    if death_reason(event_type, pod, lost_nodes) is not None or is_ready(pod):
        return None
    return facts.group


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
