"""Registry entries desired from observed pods, and the changes that bring etcd there. Pure.

Every READY group (``status.group_views``) is advertised by one ``tandem.registry.Endpoint`` built from its rank-0
pod: the SGLang URL ``http://<pod ip>:<http port>``, the prefill bootstrap port of its epoch, the Mooncake session ids
every member pod may take (``<pod ip>:<port>`` for each port of its epoch's window), the RDMA devices, the pod's
compatibility revision and its epoch (the group's incarnation), and with ``spec.fabric`` the fabric domain of the
leader's node and the mode routers pair by. A group fenced at its current epoch is not advertised again until it
is recreated with a higher epoch.
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping
from dataclasses import dataclass

from tandem.registry import Endpoint, Role
from tandem_operator.api.pdcluster import PDClusterSpec, TransferProtocol
from tandem_operator.decide.observe import GroupKey, GroupState, GroupView, Pod, pod_facts
from tandem_operator.desired.naming import LABEL_REVISION


def session_ids(members: Iterable[Pod]) -> tuple[str, ...]:
    """``ip:port`` for every port of every member's Mooncake window, rank by rank (members without an IP: none)."""
    ranked = sorted((facts.rank, facts) for pod in members if (facts := pod_facts(pod)) is not None and facts.ip)
    return tuple(f"{facts.ip}:{port}" for _, facts in ranked for port in facts.mooncake_ports)


def _epoch_of(pod: Pod) -> int | None:
    facts = pod_facts(pod)
    return facts.epoch if facts is not None else None


def leader_endpoint(
    spec: PDClusterSpec,
    role: Role,
    leader: Pod,
    members: Iterable[Pod] = (),
    node_domains: Mapping[str, str] | None = None,
) -> Endpoint | None:
    """The endpoint of a group whose leader (rank 0) is ``leader`` and whose pods are ``members`` (the leader
    alone if empty); None while it has no IP, or an IPv6 one (the registry's Mooncake session id is ``ip:port``,
    which the shared schema defines for IPv4 only). ``node_domains``: the fabric domain of each node that has one
    (``spec.fabric.domainLabel``'s value); a leader on a node missing there is registered with an unknown domain."""
    facts = pod_facts(leader)
    if facts is None or facts.ip is None or facts.rank != 0 or ":" in facts.ip:
        return None
    fabric = spec.fabric
    domain = (node_domains or {}).get(facts.node) if fabric is not None and facts.node is not None else None
    ports = spec.role(role).ports
    labels = (leader.get("metadata") or {}).get("labels") or {}
    return Endpoint(
        role=role,
        group=facts.group.name,
        url=f"http://{facts.ip}:{ports.http}",
        bootstrap_port=ports.bootstrap_at(facts.epoch) if role is Role.PREFILL else None,
        mooncake_sessions=session_ids(m for m in members or [leader] if _epoch_of(m) == facts.epoch),
        ib_devices=tuple(spec.transfer.ib_devices) if spec.transfer.protocol is TransferProtocol.RDMA else (),
        attn_dp_size=spec.role(role).attn_dp_size,
        model=spec.model.served_name,
        revision=labels.get(LABEL_REVISION, ""),
        epoch=facts.epoch,
        fabric_domain=domain,
        fabric_mode=fabric.mode.to_registry() if fabric is not None else None,
    )


def leader_nodes(pods: Iterable[Pod]) -> set[str]:
    """The nodes group leaders (rank 0) run on: whose fabric domain the registry entries carry."""
    return {facts.node for pod in pods if (facts := pod_facts(pod)) is not None and facts.rank == 0 and facts.node}


def desired_endpoints(
    spec: PDClusterSpec,
    role: Role,
    views: Mapping[int, GroupView],
    pods: Iterable[Pod],
    fenced: Mapping[GroupKey, int],
    node_domains: Mapping[str, str] | None = None,
) -> dict[GroupKey, Endpoint]:
    """Endpoints of the role's READY groups, except those fenced at the epoch their pods carry (``node_domains``:
    as for ``leader_endpoint``)."""
    leaders: dict[int, Pod] = {}
    members: dict[int, list[Pod]] = {}
    for pod in pods:
        facts = pod_facts(pod)
        if facts is not None and facts.group.role is role:
            members.setdefault(facts.group.index, []).append(pod)
            if facts.rank == 0:
                leaders[facts.group.index] = pod
    result: dict[GroupKey, Endpoint] = {}
    for index, view in views.items():
        if view.state is not GroupState.READY or index not in leaders:
            continue
        endpoint = leader_endpoint(spec, role, leaders[index], members[index], node_domains)
        key = GroupKey(role, index)
        if endpoint is not None and fenced.get(key) != endpoint.epoch:
            result[key] = endpoint
    return result


@dataclass(frozen=True)
class RegistryChanges:
    put: dict[GroupKey, Endpoint]
    remove: dict[GroupKey, Endpoint]


def registry_changes(desired: Mapping[GroupKey, Endpoint], current: Mapping[GroupKey, Endpoint]) -> RegistryChanges:
    """Puts for new or changed entries, removals for entries no longer desired."""
    put = {key: ep for key, ep in desired.items() if current.get(key) != ep}
    remove = {key: ep for key, ep in current.items() if key not in desired}
    return RegistryChanges(put, remove)


def parse_group(endpoint: Endpoint) -> GroupKey | None:
    """The group key of a registry entry written by the operator (``<role>-<index>``), else None."""
    prefix, _, index = endpoint.group.rpartition("-")
    if prefix != endpoint.role.value or not index.isdigit():
        return None
    return GroupKey(endpoint.role, int(index))


def next_epoch(*seen: int | None) -> int:
    """The epoch of a group's next incarnation: one more than any epoch seen for it (Service, pods, registry)."""
    known = [e for e in seen if e is not None]
    return max(known) + 1 if known else 0
