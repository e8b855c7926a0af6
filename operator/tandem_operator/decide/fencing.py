"""Which group to fence, given one pod or node event, and which stale Mooncake keys to remove. Pure.

Fencing is the first, event-driven step of recovery: the group's registry key is deleted so routers stop sending
it requests, before anything slower (Events, pod deletions, the reconcile) happens. A pod event fences its group
only when the pod is dead (``observe.pod_health``: deleted, terminating, Failed, a container exited or restarted,
on a lost node): only then is the group recreated. A pod that merely turned NotReady while its group was registered
(a busy worker's slow ``/health``) is *unrouted* (``unroute_decision``): its registry entry is removed, nothing
else, and the reconcile registers it again with the same epoch when it is Ready. Groups the operator itself is
retiring (scale-down, rollout) are not fenced: the reconcile unregisters them before deleting their pods, and
their end is not a recovery.

A node that turns NotReady (kubelet or node controller says so: a kubelet-lease or API-server blip as often as a
dead machine) takes its groups out of routing at once (``unroute_decision``) and fences them only once it has stayed
NotReady for ``lifecycle.nodeLostGraceSeconds`` (``node_verdicts``): a 40-second blip must not cost a ~600 GB
reload. A node that is deleted is lost at once, and so is any member whose pod or container is seen dead meanwhile.

Mooncake writes ``mooncake/[<cluster_id>/]rpc_meta/<server>`` and ``.../ram/<segment>`` without a lease, where the
server / segment name is the ``local_hostname`` given to ``TransferEngine.initialize``: the pod IP, or
``<ip>:<port>`` (measured with mooncake-transfer-engine 0.3.13). A restarted peer of the same name is unreachable
while the stale entries stay cached, so every member's entries are removed when its group is fenced.
"""

from __future__ import annotations

from collections.abc import Collection, Iterable, Mapping
from dataclasses import dataclass
from datetime import UTC, datetime
from enum import StrEnum
from typing import Any

from tandem_operator.decide.observe import GroupKey, Pod, PodFacts, PodHealth, is_ready, pod_facts, pod_health

MOONCAKE_ROOT = "mooncake/"


class FenceReason(StrEnum):
    POD_DELETED = "PodDeleted"
    POD_TERMINATING = "PodTerminating"
    POD_FAILED = "PodFailed"
    CONTAINER_RESTARTED = "ContainerRestarted"
    NODE_LOST = "NodeLost"  # the node was deleted, or NotReady for lifecycle.nodeLostGraceSeconds
    START_DEADLINE = "StartDeadlineExceeded"  # Starting/Incomplete past lifecycle.startDeadlineSeconds
    DOWNLOAD_DEADLINE = "WeightDownloadDeadlineExceeded"  # prefetching past lifecycle.weightDownloadDeadlineSeconds
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


@dataclass(frozen=True)
class PodEvent:
    """One pod event, parsed once for both deciders (``fence_decision``, ``unroute_decision``): the member it is
    (None: not a group member of ours), why it can no longer serve (None: alive) and whether it is Ready."""

    facts: PodFacts | None
    death: FenceReason | None
    ready: bool


def pod_event(event_type: str, pod: Pod, lost_nodes: Collection[str]) -> PodEvent:
    facts = pod_facts(pod)
    death = death_reason(event_type, pod, lost_nodes) if facts is not None else None
    return PodEvent(facts, death, is_ready(pod))


def fence_decision(event: PodEvent, *, fenced: Mapping[GroupKey, int], retiring: Collection[GroupKey]) -> Fence | None:
    """The fence one pod event calls for.

    ``fenced``: group -> epoch already fenced (one fence per incarnation); ``retiring``: groups the operator is
    deleting on purpose.
    """
    facts = event.facts
    if facts is None or facts.group in retiring or event.death is None:
        return None
    if fenced.get(facts.group) == facts.epoch:
        return None
    return Fence(facts.group, facts.epoch, event.death, facts.name)


def unroute_decision(
    event: PodEvent, *, registered: Mapping[GroupKey, int], unreachable_nodes: Collection[str] = ()
) -> GroupKey | None:
    """The registered group to take out of rotation because this live member turned NotReady or its node did
    (``unreachable_nodes``: NotReady within the grace), else None.

    Readiness only gates routing: the group keeps its pods and epoch, and is registered again once Ready.
    """
    facts = event.facts
    if facts is None or registered.get(facts.group) != facts.epoch:
        return None  # not serving at this incarnation (still starting, or an older one)
    if event.death is not None:
        return None
    if event.ready and facts.node not in unreachable_nodes:
        return None
    return facts.group


@dataclass(frozen=True)
class NodeOutage:
    """A node that is not Ready: ``gone`` (deleted, or being deleted), else NotReady since ``since``."""

    gone: bool
    since: datetime


def _timestamp(raw: object) -> datetime | None:
    try:
        stamp = datetime.fromisoformat(str(raw)) if raw else None
    except ValueError:
        return None
    return stamp.replace(tzinfo=UTC) if stamp is not None and stamp.tzinfo is None else stamp


def node_outage(
    event_type: str, node: Mapping[str, Any], now: datetime, previous: NodeOutage | None
) -> NodeOutage | None:
    """The node's outage after this event, or None when it is Ready (or registering: no Ready condition yet).

    NotReady (Ready condition False or Unknown) counts from the condition's ``lastTransitionTime``, so an operator
    that starts while a node is down counts the time it was down before; ``previous`` (what this operator saw) keeps
    the earliest start across False -> Unknown (the node controller restamps the transition). A missing or
    future stamp (clock skew) counts from ``now``.
    """
    since = previous.since if previous is not None else now
    if event_type == "DELETED" or (node.get("metadata") or {}).get("deletionTimestamp"):
        return NodeOutage(gone=True, since=since)
    conditions = (node.get("status") or {}).get("conditions") or ()
    ready = next((c for c in conditions if c.get("type") == "Ready"), None)
    if ready is None or ready.get("status") == "True":
        return None
    stamp = _timestamp(ready.get("lastTransitionTime"))
    if stamp is not None and stamp <= now:
        since = min(since, stamp)
    return NodeOutage(gone=False, since=since)


@dataclass(frozen=True)
class NodeVerdicts:
    """What the cluster's nodes mean for its groups at one instant."""

    lost: frozenset[str] = frozenset()  # deleted, or NotReady for the grace: their pods are dead (fence)
    unreachable: frozenset[str] = frozenset()  # NotReady within the grace: out of routing only, nothing deleted
    next_check_s: float | None = None  # seconds until the first unreachable node's grace runs out
    cordoned: frozenset[str] = frozenset()  # spec.unschedulable (drain, upgrade, autoscaler): move their groups


def node_verdicts(
    outages: Mapping[str, NodeOutage], grace_s: float, now: datetime, cordoned: Collection[str] = ()
) -> NodeVerdicts:
    """Lost and unreachable nodes under the grace ``lifecycle.nodeLostGraceSeconds``, and the cordoned ones."""
    lost: set[str] = set()
    unreachable: set[str] = set()
    left: list[float] = []
    for name, outage in outages.items():
        remaining = grace_s - (now - outage.since).total_seconds()
        if outage.gone or remaining <= 0:
            lost.add(name)
        else:
            unreachable.add(name)
            left.append(remaining)
    return NodeVerdicts(frozenset(lost), frozenset(unreachable), min(left) if left else None, frozenset(cordoned))


def node_cordoned(event_type: str, node: Mapping[str, Any]) -> bool:
    """The node is cordoned (``spec.unschedulable``: ``kubectl cordon`` / ``drain``, cluster-autoscaler's scale-down,
    a managed node upgrade): its groups are to be moved before their pods are evicted. A deleted node is not: its
    groups are lost (``node_outage``)."""
    return event_type != "DELETED" and bool((node.get("spec") or {}).get("unschedulable"))


def groups_on_nodes(pods: Iterable[Pod], nodes: Collection[str]) -> frozenset[GroupKey]:
    """The groups with a pod on one of ``nodes``."""
    return frozenset(f.group for f in (pod_facts(p) for p in pods) if f is not None and f.node in nodes)


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
