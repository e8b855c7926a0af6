"""Pods and headless Services of one group. Pure: ``group_manifests(ctx, group)`` returns dicts to apply.

A group is one SGLang server over ``nodesPerGroup`` pods, one per node: rank 0 is the leader. The group's headless
Service selects only the leader and publishes it before it is Ready, so ``<group>.<namespace>.svc`` is the
leader's stable address for ``--dist-init-addr`` and for prefill bootstrap registration, whatever its pod IP.
Pods use ``restartPolicy: Never``: NCCL cannot lose a rank, so a dead member fails its pod and the operator
recreates the whole group (gang semantics) instead of the kubelet restarting one rank into a broken group.
"""

from __future__ import annotations

from dataclasses import dataclass, replace
from typing import Any

from tandem.registry import Role
from tandem_operator.api.mooncake_ports import ports_needed
from tandem_operator.api.pdcluster import PDClusterSpec, TransferProtocol
from tandem_operator.desired.args import Placement, launch_command
from tandem_operator.desired.drain_hook import EXIT_GRACE_S, prestop_command
from tandem_operator.desired.fabric import fabric_affinity_terms
from tandem_operator.desired.naming import (
    ANNOTATION_BOOTSTRAP_PORT,
    COMMON_LABELS,
    LABEL_RANK,
    LABEL_REVISION,
    LABEL_TEMPLATE_HASH,
    ClusterRef,
    OwnerRef,
    compat_revision,
    group_labels,
    group_name,
    mooncake_cluster_id,
    pod_name,
    template_hash,
)
from tandem_operator.desired.probes import health_env, probes
from tandem_operator.desired.recipe import (
    cache_volumes,
    cached_weights_affinity,
    collective_env,
    gang_pod_fields,
    group_objects,
    prefetch_containers,
    store_env,
    store_of,
)
from tandem_operator.desired.security import (
    pod_security_context,
    with_min_requests,
    worker_security_context,
)
from tandem_operator.desired.seeding import Seed, weight_annotations

GPU_RESOURCE = "nvidia.com/gpu"
CONTAINER = "sglang"
HOSTNAME_TOPOLOGY = "kubernetes.io/hostname"


@dataclass(frozen=True)
class RoleContext:
    """Everything the manifests of one role depend on, hashed once."""

    cluster: ClusterRef
    spec: PDClusterSpec
    role: Role
    owner: OwnerRef  # the role's PDPool: deleting it garbage-collects pods and Services
    template_hash: str
    revision: str

    @classmethod
    def build(cls, cluster: ClusterRef, spec: PDClusterSpec, role: Role, owner: OwnerRef) -> RoleContext:
        unhashed = cls(cluster, spec, role, owner, "", compat_revision(spec))
        return replace(unhashed, template_hash=template_hash(revision_pods(unhashed)))


def revision_pods(ctx: RoleContext) -> list[dict[str, Any]]:
    """The pods the role's revision is taken over (``naming.template_hash``): every rank of one group, group 0 at
    epoch 0, so what differs by group, rank or incarnation differs the same way in every rendering."""
    return [group_pod(ctx, 0, rank) for rank in range(ctx.spec.role(ctx.role).nodes_per_group)]


def leader_address(ctx: RoleContext, group: int) -> str:
    return f"{group_name(ctx.cluster.name, ctx.role, group)}.{ctx.cluster.namespace}.svc"


def _leader_url(ctx: RoleContext, group: int) -> str:
    """The group leader's HTTP server by its Service name (every rank's preStop reads the leader's gauges)."""
    return f"http://{leader_address(ctx, group)}:{ctx.spec.role(ctx.role).ports.http}"


def group_manifests(ctx: RoleContext, group: int, epoch: int = 0) -> list[dict[str, Any]]:
    """The group's Service, its PodDisruptionBudget (and PodGroup), then its pods by rank (of incarnation
    ``epoch``)."""
    nodes = ctx.spec.role(ctx.role).nodes_per_group
    pods = [group_pod(ctx, group, rank, epoch) for rank in range(nodes)]
    return [group_service(ctx, group), *group_extras(ctx, group), *pods]


def group_extras(ctx: RoleContext, group: int) -> list[dict[str, Any]]:
    """Objects that live and go with the group besides its Service: PodDisruptionBudget, PodGroup."""
    labels = group_labels(ctx.cluster.name, ctx.role, group)
    metadata = _metadata(ctx, group_name(ctx.cluster.name, ctx.role, group), labels)
    return group_objects(ctx.spec, ctx.role, metadata, labels)


def _metadata(ctx: RoleContext, name: str, labels: dict[str, str]) -> dict[str, Any]:
    return {
        "name": name,
        "namespace": ctx.cluster.namespace,
        "labels": {**COMMON_LABELS, **labels},
        "ownerReferences": [ctx.owner.to_manifest()],
    }


def group_service(ctx: RoleContext, group: int) -> dict[str, Any]:
    ports = ctx.spec.role(ctx.role).ports
    service_ports = [
        {"name": "http", "port": ports.http, "targetPort": ports.http},
        {"name": "dist-init", "port": ports.dist_init, "targetPort": ports.dist_init},
    ]
    if ctx.role is Role.PREFILL:
        # The pod's bootstrap port moves with its epoch (PortSet.bootstrap_at): the Service names it.
        service_ports.append({"name": "bootstrap", "port": ports.bootstrap, "targetPort": "bootstrap"})
    labels = group_labels(ctx.cluster.name, ctx.role, group)
    return {
        "apiVersion": "v1",
        "kind": "Service",
        "metadata": _metadata(ctx, group_name(ctx.cluster.name, ctx.role, group), labels),
        "spec": {
            "clusterIP": "None",
            "publishNotReadyAddresses": True,
            "selector": {**labels, LABEL_RANK: "0"},
            "ports": service_ports,
        },
    }


def mooncake_port_range(ctx: RoleContext) -> tuple[int, int]:
    """The role's first pod window, ``MC_MIN_RPC_PORT``, ``MC_MAX_RPC_PORT`` at epoch 0: ``ports_needed`` ports from
    ``ports.mooncakeRpc``, one per rank for rdma, two per rank for tcp (each rank's engine also takes its TCP data
    port from the range); ``mooncake_ports`` moves it by epoch.

    A pod runs one SGLang scheduler, hence one Mooncake engine, per GPU rank (``tandem_operator.api.mooncake_ports``).
    One fixed port, as pods had before, starts rank 0 only: ranks 1..7 of an 8-GPU pod fail with "No valid port".
    """
    role = ctx.spec.role(ctx.role)
    rpc = role.ports.mooncake_rpc
    needed = ports_needed(
        role.tp_size // role.nodes_per_group,
        ctx.spec.transfer.protocol,
        ctx.spec.has_store(ctx.role),
        ctx.spec.peer_loading.enabled,
    )
    return rpc, rpc + needed - 1


def rotate_window(window: tuple[int, int], declared_ports: int, epoch: int) -> tuple[int, int]:
    """The window of incarnation ``epoch``: ``window`` (the first one) moved by whole windows through the declared
    range ``[window[0], window[0] + declared_ports)``, wrapping around; a range of one window never moves.

    A recreated pod should not come back under a Mooncake session id (``ip:port``) that peers still hold for the
    dead one: peers keep its cached segment descriptor (TCP data port, buffers) and pooled connections under that
    name, and SGLang un-blacklists the name when a probe of the new process succeeds (operator/README.md). Moving by
    epoch keeps consecutive incarnations apart; once the range wraps an id may come back at an old address, which
    the pods' recovery settings make safe for clients (tests/operator/test_session_rotation_live.py).
    """
    low, high = window
    size = high - low + 1
    index = epoch % max(declared_ports // size, 1)
    return low + index * size, high + index * size


def mooncake_ports(ctx: RoleContext, epoch: int) -> tuple[int, int]:
    """``MC_MIN_RPC_PORT``, ``MC_MAX_RPC_PORT`` of the role's pods at ``epoch``."""
    return rotate_window(mooncake_port_range(ctx), ctx.spec.role(ctx.role).ports.mooncake_ports, epoch)


def _env(ctx: RoleContext, epoch: int) -> list[dict[str, Any]]:
    spec, role = ctx.spec, ctx.spec.role(ctx.role)
    transfer = spec.transfer
    low, high = mooncake_ports(ctx, epoch)
    env: dict[str, dict[str, Any]] = {
        "POD_IP": {"valueFrom": {"fieldRef": {"fieldPath": "status.podIP"}}},
        "POD_NAME": {"valueFrom": {"fieldRef": {"fieldPath": "metadata.name"}}},
        # The address SGLang 0.5.23 gives peers (the KV manager's local_ip for PD bootstrap in
        # sglang/srt/disaggregation/common/conn.py, the Mooncake transfer engine's hostname in
        # sglang/srt/distributed/device_communicators/mooncake_transfer_engine.py): get_local_ip_auto in
        # sglang/srt/utils/network.py reads SGLANG_HOST_IP (or HOST_IP) first, else takes the source address of a
        # route to 8.8.8.8, which on a multi-NIC host (hostNetwork) need not be the pod IP the operator registers.
        "SGLANG_HOST_IP": {"valueFrom": {"fieldRef": {"fieldPath": "status.podIP"}}},
        # The worker entrypoint finds the RDMA devices at start when rdma is asked for and ibDevices is empty.
        "TANDEM_TRANSFER_PROTOCOL": {"value": transfer.protocol.value},
        "MC_MIN_RPC_PORT": {"value": str(low)},
        "MC_MAX_RPC_PORT": {"value": str(high)},
        "MC_TE_METRIC": {"value": "true"},
        "MC_METADATA_CLUSTER_ID": {"value": mooncake_cluster_id(ctx.cluster)},
        # Peers re-read cached descriptors this often, so they reach a peer that came back under the same name.
        "MC_TE_METADATA_REFRESH_INTERVAL_SECONDS": {"value": str(transfer.metadata_refresh_seconds)},
        # A prefill probes a decode session it blacklisted this often (SGLang: 30 s, doubling up to 300 s).
        "SGLANG_FAILED_SESSION_PROBE_INTERVAL_S": {"value": str(transfer.failed_session_probe_seconds)},
        "SGLANG_FAILED_SESSION_PROBE_MAX_INTERVAL_S": {"value": str(transfer.failed_session_probe_max_seconds)},
        # SGLang's health-check timeout: longer than any batch, so only a stuck scheduler fails a check
        **health_env(),
    }
    if transfer.disable_metadata_cache:
        env["MC_DISABLE_METACACHE"] = {"value": "true"}
    if transfer.protocol is TransferProtocol.TCP:
        env["MC_FORCE_TCP"] = {"value": "true"}
        # Mooncake binds all interfaces unless told; peers must reach the pod's own address.
        env["MC_TCP_BIND_ADDRESS"] = {"valueFrom": {"fieldRef": {"fieldPath": "status.podIP"}}}
    store = store_of(spec, ctx.role)
    recipe = {**(store_env(spec, role, store) if store is not None else {}), **collective_env(spec)}
    env.update({name: {"value": value} for name, value in recipe.items()})
    for var in role.env:  # the user's values win
        env[var.name] = {"value": var.value}
    return [{"name": name, **value} for name, value in env.items()]


def _resources(ctx: RoleContext) -> dict[str, Any]:
    role, transfer = ctx.spec.role(ctx.role), ctx.spec.transfer
    devices = {GPU_RESOURCE: str(role.gpus_per_node)}
    if transfer.protocol is TransferProtocol.RDMA and transfer.rdma_resource is not None:
        devices[transfer.rdma_resource] = "1"
    limits = {name: str(value) for name, value in role.resources.limits.items()}
    requests = with_min_requests({name: str(value) for name, value in role.resources.requests.items()}, limits)
    return {"requests": {**requests, **devices}, "limits": {**limits, **devices}}


def _container_ports(ctx: RoleContext, epoch: int) -> list[dict[str, Any]]:
    ports = ctx.spec.role(ctx.role).ports
    named = [("http", ports.http), ("dist-init", ports.dist_init)]
    if ctx.role is Role.PREFILL:
        named.append(("bootstrap", ports.bootstrap_at(epoch)))
    low, high = mooncake_ports(ctx, epoch)
    named += [(f"mooncake-{i}", port) for i, port in enumerate(range(low, high + 1))]
    host = ctx.spec.transfer.host_network
    # With hostNetwork the ports are node ports: declaring hostPort lets the scheduler keep clashing pods apart.
    return [
        {"name": name, "containerPort": port, "protocol": "TCP", **({"hostPort": port} if host else {})}
        for name, port in named
    ]


def _volumes(ctx: RoleContext) -> tuple[list[dict[str, Any]], list[dict[str, Any]]]:
    role, model = ctx.spec.role(ctx.role), ctx.spec.model
    volumes: list[dict[str, Any]] = [
        {"name": "dshm", "emptyDir": {"medium": "Memory", "sizeLimit": str(role.shm_size)}}
    ]
    mounts: list[dict[str, Any]] = [{"name": "dshm", "mountPath": "/dev/shm"}]
    if _uses_host_infiniband(ctx):
        volumes.append({"name": "infiniband", "hostPath": {"path": "/dev/infiniband", "type": "Directory"}})
        mounts.append({"name": "infiniband", "mountPath": "/dev/infiniband"})
    if model.pvc is not None:
        volumes.append({"name": "model", "persistentVolumeClaim": {"claimName": model.pvc, "readOnly": True}})
        mounts.append({"name": "model", "mountPath": model.mount_path, "readOnly": True})
    cache_vols, cache_mounts = cache_volumes(ctx.spec)
    return volumes + cache_vols, mounts + cache_mounts


def _uses_host_infiniband(ctx: RoleContext) -> bool:
    transfer = ctx.spec.transfer
    return transfer.protocol is TransferProtocol.RDMA and transfer.rdma_resource is None


def _affinity(ctx: RoleContext, group: int, rank: int) -> dict[str, Any]:
    labels = group_labels(ctx.cluster.name, ctx.role, group)
    affinity: dict[str, Any] = {
        "podAntiAffinity": {  # one pod of a group per node
            "requiredDuringSchedulingIgnoredDuringExecution": [
                {"labelSelector": {"matchLabels": labels}, "topologyKey": HOSTNAME_TOPOLOGY}
            ]
        }
    }
    topology_key = ctx.spec.role(ctx.role).topology_key
    terms = fabric_affinity_terms(ctx.spec, labels)  # every rank: the group stays in one RDMA fabric domain
    if topology_key is not None and rank > 0:  # follow the leader into its rack / NVLink or IB block
        terms.append({"labelSelector": {"matchLabels": {**labels, LABEL_RANK: "0"}}, "topologyKey": topology_key})
    if terms:
        affinity["podAffinity"] = {"requiredDuringSchedulingIgnoredDuringExecution": terms}
    return {**affinity, **cached_weights_affinity(ctx.spec)}  # prefer nodes that hold the weights


def group_pod(ctx: RoleContext, group: int, rank: int, epoch: int = 0, seed: Seed | None = None) -> dict[str, Any]:
    """Pod ``rank`` of the group's incarnation ``epoch`` (its Mooncake port window and a prefill's bootstrap port
    depend on the epoch), loading its weights from ``seed`` with ``spec.peerLoading`` (else from the node's copy;
    the revision is rendered without one: the seed is the incarnation's, not the template's)."""
    spec, role = ctx.spec, ctx.spec.role(ctx.role)
    drain_s = spec.lifecycle.drain_timeout_seconds
    labels = {
        **group_labels(ctx.cluster.name, ctx.role, group),
        LABEL_RANK: str(rank),
        LABEL_REVISION: ctx.revision,
        LABEL_TEMPLATE_HASH: ctx.template_hash,
    }
    metadata = _metadata(ctx, pod_name(ctx.cluster.name, ctx.role, group, rank), labels)
    if ctx.role is Role.PREFILL and rank == 0:
        metadata["annotations"] = {ANNOTATION_BOOTSTRAP_PORT: str(role.ports.bootstrap_at(epoch))}
    if spec.peer_loading.enabled:
        metadata["annotations"] = {**metadata.get("annotations", {}), **weight_annotations(seed)}
    volumes, mounts = _volumes(ctx)
    address = leader_address(ctx, group)
    placement = Placement(role=ctx.role, node_rank=rank, leader_address=address, epoch=epoch, seed=seed)
    env = _env(ctx, epoch)
    resources = _resources(ctx)
    container = {
        "name": CONTAINER,
        "image": spec.images.worker,
        "imagePullPolicy": spec.images.pull_policy,
        # args, not command: a command would replace the image's ENTRYPOINT, and the worker image's
        # (images/sglang-worker/entrypoint.sh) checks the pod and finds its interfaces and RDMA devices first.
        "args": launch_command(spec, placement),
        "env": env,
        "ports": _container_ports(ctx, epoch),
        "resources": resources,
        # A hostPath /dev/infiniband is unusable without device access (desired/security.py).
        "securityContext": worker_security_context(privileged=_uses_host_infiniband(ctx)),
        "volumeMounts": mounts,
        **probes(spec, ctx.role, rank),  # desired/probes.py: readiness /ready, liveness /health_generate
        # Pods deleted by others (eviction, kubectl delete) wait for the group's in-flight work, as the operator's
        # own drain does; the grace period leaves SGLang EXIT_GRACE_S after the hook. The hook gives up on a leader
        # that is not ready (a hung scheduler drains nothing), and a liveness or startup kill has its probe's own
        # grace (desired/probes.py), not this one.
        "lifecycle": {"preStop": {"exec": {"command": prestop_command(_leader_url(ctx, group), drain_s)}}},
    }
    pod_spec: dict[str, Any] = {
        "restartPolicy": "Never",
        "enableServiceLinks": False,
        "securityContext": pod_security_context(),
        "terminationGracePeriodSeconds": drain_s + EXIT_GRACE_S,
        "containers": [container],
        "volumes": volumes,
        "affinity": _affinity(ctx, group, rank),
    }
    if spec.transfer.host_network:
        pod_spec["hostNetwork"] = True
        pod_spec["dnsPolicy"] = "ClusterFirstWithHostNet"  # still resolve the leader's Service name
    if role.node_selector:
        pod_spec["nodeSelector"] = dict(role.node_selector)
    if role.tolerations:
        pod_spec["tolerations"] = [t.to_wire() for t in role.tolerations]
    if spec.images.pull_secrets:
        pod_spec["imagePullSecrets"] = [{"name": name} for name in spec.images.pull_secrets]
    init = prefetch_containers(spec, env, resources["requests"])
    if init:
        pod_spec["initContainers"] = init
    gang = gang_pod_fields(spec, ctx.role, group_name(ctx.cluster.name, ctx.role, group))
    metadata["labels"].update(gang["labels"])
    if gang["annotations"]:
        metadata["annotations"] = {**metadata.get("annotations", {}), **gang["annotations"]}
    if gang["schedulerName"]:
        pod_spec["schedulerName"] = gang["schedulerName"]
    return {"apiVersion": "v1", "kind": "Pod", "metadata": metadata, "spec": pod_spec}
