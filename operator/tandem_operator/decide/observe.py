"""Pod observation: what one worker pod is (``PodFacts``), how healthy it is, and its group's state. Pure.

A pod is DEAD when it is being deleted, has terminated (Failed/Succeeded), restarted a container (NCCL lost the
rank even if the kubelet brought it back) or sits on a node the caller knows is lost; a live pod on a node that is
NotReady but not lost yet (``unreachable_nodes``, within ``lifecycle.nodeLostGraceSeconds``) is not READY whatever
its own condition says (its kubelet may not be able to report). A group is:

* READY when every rank is present and Ready;
* BROKEN when any member is dead, or a rank is missing after some member had become Ready (the NCCL group had
  formed and lost a rank): the whole group must be recreated, never left half-alive;
* INCOMPLETE when ranks are missing but none had become Ready yet (still being created: create the rest);
* STARTING otherwise (all present, not all Ready).
"""

from __future__ import annotations

from collections import defaultdict
from collections.abc import Iterable, Mapping
from dataclasses import dataclass
from datetime import datetime
from enum import StrEnum
from typing import Any

from tandem.registry import Role
from tandem_operator.api.mooncake_ports import MAX_PORTS_PER_POD
from tandem_operator.desired.naming import (
    ANNOTATION_DESIRED_HASH,
    ANNOTATION_EPOCH,
    ANNOTATION_GENERATION,
    LABEL_CLUSTER,
    LABEL_GROUP,
    LABEL_RANK,
    LABEL_REVISION,
    LABEL_ROLE,
    LABEL_TEMPLATE_HASH,
    PREFETCH_CONTAINER,
)

Pod = Mapping[str, Any]
# The worker env the deciders read: Mooncake's port range (``PodFacts.mooncake_ports``) and its metadata root
# (``fencing``'s stale-key cleanup). A worker has ~20 literal env values; only these are kept.
KEPT_ENV = frozenset({"MC_MIN_RPC_PORT", "MC_MAX_RPC_PORT", "MC_METADATA_CLUSTER_ID"})
MAX_NAMED_PORTS = MAX_PORTS_PER_POD  # a hostNetwork pod's Mooncake names are cleaned one port at a time


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
    """What the operator needs to know about one worker pod."""

    name: str
    namespace: str
    cluster: str
    group: GroupKey
    rank: int
    epoch: int
    ip: str | None
    node: str | None
    env: Mapping[str, str]  # the worker container's literal values of the KEPT_ENV names
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
    env = {e["name"]: e["value"] for e in containers[0].get("env") or () if "value" in e and e.get("name") in KEPT_ENV}
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


TANDEM_ANNOTATION_PREFIX = "tandem.dev/"


def slim_pod(pod: Pod) -> dict[str, Any]:
    """The part of a pod the deciders read (``pod_facts``, ``pod_health``, ``started``, ``created_at``,
    ``prefetch``, the planner's ``deletionTimestamp``), nothing else: the operator keeps one per worker pod. A full
    pod with its ``managedFields`` is ~20x larger (measured: 1,000 pods held whole took ~60 MiB of the operator's
    RSS); of the rest, only ``KEPT_ENV``, the Ready condition, the names of the container states and the prefetch
    init container's state (its exit code and finish time) are kept (1,000 pods of the K2.6 recipe: 11.1 MiB of heap
    with every env value, condition and state; 4.6 MiB without)."""
    metadata, spec, status = pod.get("metadata") or {}, pod.get("spec") or {}, pod.get("status") or {}
    containers = spec.get("containers") or [{}]
    env = [
        {"name": e["name"], "value": e["value"]}
        for e in containers[0].get("env") or ()
        if "value" in e and e.get("name") in KEPT_ENV
    ]
    annotations = {
        k: v for k, v in (metadata.get("annotations") or {}).items() if k.startswith(TANDEM_ANNOTATION_PREFIX)
    }
    kept_metadata = {k: metadata[k] for k in ("name", "namespace", "labels", "creationTimestamp") if k in metadata}
    if metadata.get("deletionTimestamp"):
        kept_metadata["deletionTimestamp"] = metadata["deletionTimestamp"]
    return {
        "metadata": {**kept_metadata, "annotations": annotations},
        "spec": {
            "nodeName": spec.get("nodeName"),
            "hostNetwork": bool(spec.get("hostNetwork")),
            "containers": [{"env": env}],
            "initContainers": [{"name": PREFETCH_CONTAINER} for _ in _prefetch_spec(pod)],
        },
        "status": {
            "phase": status.get("phase"),
            "podIP": status.get("podIP"),
            "conditions": [
                {"type": "Ready", "status": c.get("status")}
                for c in status.get("conditions") or ()
                if c.get("type") == "Ready"
            ],
            "containerStatuses": [
                {
                    "restartCount": c.get("restartCount", 0),
                    "started": c.get("started"),
                    "state": {k: {} for k in c.get("state") or {}},  # pod_health asks only "terminated" in it
                }
                for c in status.get("containerStatuses") or ()
            ],
            "initContainerStatuses": [_slim_prefetch_status(c) for c in _prefetch_statuses(pod)],
        },
    }


def _slim_prefetch_status(status: Mapping[str, Any]) -> dict[str, Any]:
    """What ``prefetch`` reads of the prefetch init container's status."""
    state, last = status.get("state") or {}, status.get("lastState") or {}
    slim: dict[str, Any] = {k: {} for k in state if k != "terminated"}
    if "terminated" in state:
        terminated = state["terminated"] or {}
        slim["terminated"] = {k: terminated[k] for k in ("exitCode", "finishedAt") if k in terminated}
    return {
        "name": PREFETCH_CONTAINER,
        "restartCount": status.get("restartCount", 0),
        "state": slim,
        "lastState": {k: {} for k in last},
    }


def group_of(pod: Pod) -> GroupKey | None:
    facts = pod_facts(pod)
    return None if facts is None else facts.group


class PodHealth(StrEnum):
    READY = "Ready"
    STARTING = "Starting"
    DEAD = "Dead"


class GroupState(StrEnum):
    READY = "Ready"
    STARTING = "Starting"
    INCOMPLETE = "Incomplete"
    BROKEN = "Broken"


@dataclass(frozen=True)
class GroupView:
    index: int
    state: GroupState
    template_hash: str  # "" when the ranks disagree (a half-rolled group counts as outdated)
    pods: tuple[str, ...]
    revision: str = ""  # compatibility revision of its pods ("" when the ranks disagree)
    # The lowest PDCluster generation stamped on its pods (None when one has none: made before stamps existed) and
    # the template hash wanted then ("" when absent or the ranks disagree): upgrade.py
    generation: int | None = None
    desired_hash: str = ""


def is_ready(pod: Pod) -> bool:
    conditions = (pod.get("status") or {}).get("conditions") or ()
    return any(c.get("type") == "Ready" and c.get("status") == "True" for c in conditions)


def started(pod: Pod) -> bool:
    """Every container started (the kubelet sets ``started`` once the startupProbe passed: the model is loaded)."""
    statuses = (pod.get("status") or {}).get("containerStatuses") or ()
    return bool(statuses) and all(c.get("started") is True for c in statuses)


def _timestamp(raw: object) -> datetime | None:
    try:
        return datetime.fromisoformat(str(raw)) if raw else None
    except ValueError:
        return None


def created_at(pod: Pod) -> datetime | None:
    return _timestamp((pod.get("metadata") or {}).get("creationTimestamp"))


class PrefetchState(StrEnum):
    NONE = "None"  # the pod stages no weights (no model.weightCache.prefetch)
    WAITING = "Waiting"  # not run yet: Pending, pulling the image
    RUNNING = "Running"  # downloading, or failed and restarted: not finished successfully yet
    DONE = "Done"  # exited 0: the node holds the complete copy


@dataclass(frozen=True)
class Prefetch:
    state: PrefetchState
    finished_at: datetime | None = None  # when DONE: the kubelet's finishedAt (None if unreadable)


def _prefetch_spec(pod: Pod) -> list[Mapping[str, Any]]:
    inits = (pod.get("spec") or {}).get("initContainers") or ()
    return [c for c in inits if c.get("name") == PREFETCH_CONTAINER]


def _prefetch_statuses(pod: Pod) -> list[Mapping[str, Any]]:
    inits = (pod.get("status") or {}).get("initContainerStatuses") or ()
    return [c for c in inits if c.get("name") == PREFETCH_CONTAINER]


def prefetch(pod: Pod) -> Prefetch:
    """Where the pod's weight prefetch init container (``naming.PREFETCH_CONTAINER``) stands.

    It has run once the kubelet reports it running or terminated now, or terminated before (``lastState``, a
    restart count): a failed download is restarted by the kubelet and is still RUNNING here, bounded by
    ``lifecycle.weightDownloadDeadlineSeconds``; only exit code 0 is DONE, from which the start deadline counts.
    """
    if not _prefetch_spec(pod):
        return Prefetch(PrefetchState.NONE)
    status = next(iter(_prefetch_statuses(pod)), {})
    state = status.get("state") or {}
    terminated = state.get("terminated")
    if terminated is not None and terminated.get("exitCode") == 0:
        return Prefetch(PrefetchState.DONE, _timestamp(terminated.get("finishedAt")))
    ran = "running" in state or terminated is not None or "terminated" in (status.get("lastState") or {})
    return Prefetch(PrefetchState.RUNNING if ran or status.get("restartCount", 0) > 0 else PrefetchState.WAITING)


def staged_nodes(pods: Iterable[Pod]) -> frozenset[str]:
    """The nodes on which a pod's prefetch finished successfully: they hold the complete copy of its weights."""
    nodes = ((p.get("spec") or {}).get("nodeName") for p in pods if prefetch(p).state is PrefetchState.DONE)
    return frozenset(n for n in nodes if n)


def pod_health(
    pod: Pod, lost_nodes: frozenset[str] = frozenset(), unreachable_nodes: frozenset[str] = frozenset()
) -> PodHealth:
    metadata, status = pod.get("metadata") or {}, pod.get("status") or {}
    phase = status.get("phase")
    if metadata.get("deletionTimestamp") or phase in ("Failed", "Succeeded"):
        return PodHealth.DEAD
    for container in status.get("containerStatuses") or ():
        if container.get("restartCount", 0) > 0 or "terminated" in (container.get("state") or {}):
            return PodHealth.DEAD
    node = (pod.get("spec") or {}).get("nodeName")
    if node in lost_nodes:
        return PodHealth.DEAD
    ready = phase == "Running" and is_ready(pod) and node not in unreachable_nodes
    return PodHealth.READY if ready else PodHealth.STARTING


def group_views(
    pods: Iterable[Pod],
    nodes_per_group: int,
    lost_nodes: frozenset[str] = frozenset(),
    unreachable_nodes: frozenset[str] = frozenset(),
) -> dict[int, GroupView]:
    """Pods of one role, grouped by their group label. Pods without tandem labels are ignored."""
    by_group: dict[int, list[Pod]] = defaultdict(list)
    for pod in pods:
        labels = (pod.get("metadata") or {}).get("labels") or {}
        if str(labels.get(LABEL_GROUP, "")).isdigit() and str(labels.get(LABEL_RANK, "")).isdigit():
            by_group[int(labels[LABEL_GROUP])].append(pod)
    nodes = (lost_nodes, unreachable_nodes)
    return {index: _group_view(index, members, nodes_per_group, *nodes) for index, members in by_group.items()}


def _group_view(
    index: int, pods: list[Pod], nodes_per_group: int, lost_nodes: frozenset[str], unreachable_nodes: frozenset[str]
) -> GroupView:
    health = [pod_health(pod, lost_nodes, unreachable_nodes) for pod in pods]
    ranks = {int(pod["metadata"]["labels"][LABEL_RANK]) for pod in pods}
    hashes = {pod["metadata"]["labels"].get(LABEL_TEMPLATE_HASH, "") for pod in pods}
    revisions = {pod["metadata"]["labels"].get(LABEL_REVISION, "") for pod in pods}
    annotations = [pod["metadata"].get("annotations") or {} for pod in pods]
    stamps = [str(a.get(ANNOTATION_GENERATION, "")) for a in annotations]
    generation = min(int(s) for s in stamps) if all(s.isdigit() for s in stamps) else None
    desired = {str(a.get(ANNOTATION_DESIRED_HASH, "")) for a in annotations}
    missing = set(range(nodes_per_group)) - ranks
    if PodHealth.DEAD in health or (missing and PodHealth.READY in health):
        state = GroupState.BROKEN
    elif missing:
        state = GroupState.INCOMPLETE
    elif all(h is PodHealth.READY for h in health):
        state = GroupState.READY
    else:
        state = GroupState.STARTING
    names = tuple(sorted(pod["metadata"]["name"] for pod in pods))
    revision = revisions.pop() if len(revisions) == 1 else ""
    template_hash = hashes.pop() if len(hashes) == 1 else ""
    return GroupView(
        index, state, template_hash, names, revision, generation, desired.pop() if len(desired) == 1 else ""
    )
