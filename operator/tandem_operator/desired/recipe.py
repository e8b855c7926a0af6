"""Recipe parts of a worker pod and group: Mooncake Store env, collective-library env, JIT and weight caches,
gang scheduling and the group's disruption budget. Pure.

Sources: SGLang's LWS PD examples (NCCL_IB_HCA, NCCL_SOCKET_IFNAME, GLOO_SOCKET_IFNAME, NVSHMEM_* ), SGLang 0.5.23
``sglang/srt/environ.py`` (``SGLANG_CACHE_DIR`` and the caches it redirects), ``mooncake_store.py``
(``_parse_global_segment_size``: an integer or ``<n>gb``), Volcano / scheduler-plugins PodGroups and Kueue's
plain-pod groups.
"""

from __future__ import annotations

from typing import Any

from tandem.registry import Role
from tandem_operator.api.pdcluster import DecodeSpec, PDClusterSpec, PrefillSpec, TransferProtocol
from tandem_operator.api.recipe import MooncakeStoreSpec
from tandem_operator.desired.naming import PREFETCH_CONTAINER, STAGED_VALUE, staged_label
from tandem_operator.desired.security import init_security_context

JIT_CACHE_DIR = "/var/cache/sglang"
PODGROUP_API = {"volcano": "scheduling.volcano.sh/v1beta1", "scheduler-plugins": "scheduling.x-k8s.io/v1alpha1"}
KUEUE_GROUP_LABEL = "kueue.x-k8s.io/pod-group-name"
KUEUE_COUNT_ANNOTATION = "kueue.x-k8s.io/pod-group-total-count"
VOLCANO_GROUP_ANNOTATION = "scheduling.k8s.io/group-name"
COSCHEDULING_LABEL = "scheduling.x-k8s.io/pod-group"


def store_of(spec: PDClusterSpec, role: Role) -> MooncakeStoreSpec | None:
    """The Mooncake Store this role's HiCache uses: prefill HiCache, or decode KV offload."""
    role_spec = spec.role(role)
    if isinstance(role_spec, PrefillSpec) and role_spec.hicache.enabled:
        return role_spec.hicache.mooncake_store
    if isinstance(role_spec, DecodeSpec) and role_spec.kv_offload.enabled:
        return role_spec.kv_offload.mooncake_store
    return None


def store_env(spec: PDClusterSpec, role: PrefillSpec | DecodeSpec, store: MooncakeStoreSpec) -> dict[str, str]:
    """The Mooncake Store client's env, as SGLang 0.5.23 reads it (``MooncakeStoreConfig.load_from_env`` and
    ``MooncakeStore.__init__`` in ``sglang/srt/mem_cache/storage/mooncake_store/mooncake_store.py``):

    - ``MOONCAKE_TE_META_DATA_SERVER=P2PHANDSHAKE`` and ``MOONCAKE_DEVICE`` equal to ``--disaggregation-ib-device``:
      over rdma the Store then reuses the rank's PD transfer engine (SGLang's condition: P2PHANDSHAKE, protocol rdma,
      the same device string), so no second engine, port or hostname. With an ``etcd://`` metadata server every
      rank started a second engine whose port the PD engines had taken ("No valid port found", after the load).
    - Over tcp the Store starts a second engine per rank: it registers under ``MOONCAKE_LOCAL_HOSTNAME`` (SGLang's
      default "localhost" made every rank and pod one name), the pod's IP here, and takes its RPC and data ports
      from the rank's window, sized for it (``api.mooncake_ports.ports_per_rank``).
    - ``MOONCAKE_GLOBAL_SEGMENT_SIZE`` is divided by the attention-TP size x PP size per rank (``rank_scale_factor``;
      ``tp_size`` is ``attn_tp_size`` with attention DP: ``HiCacheController._generate_storage_config`` in
      ``sglang/srt/managers/cache_controller.py``); ``globalSegmentGib`` is per rank, so it is multiplied back.
    - ``MC_STORE_CLUSTER_ID``: the client finds its HA master under this id (Mooncake's ``MasterViewHelper``, default
      "mooncake_cluster", seen in its etcd key ``mooncake-store/<id>/master_view``); it must equal the master's
      ``--cluster_id`` (tests/sim/test_mooncake_store.py: without it the client finds no master).
    """
    etcd_hosts = ";".join(e.split("://", 1)[1] for e in spec.etcd.mooncake)
    env = {
        "MOONCAKE_MASTER": f"etcd://{etcd_hosts}" if store.master_ha else str(store.master_address),
        "MOONCAKE_TE_META_DATA_SERVER": "P2PHANDSHAKE",
        "MOONCAKE_PROTOCOL": spec.transfer.protocol.value,
        "MOONCAKE_LOCAL_HOSTNAME": "$(POD_IP)",
        "MOONCAKE_GLOBAL_SEGMENT_SIZE": f"{store.global_segment_gib * role.attn_tp_size}gb",
        "MC_STORE_CLUSTER_ID": store.cluster_id,
    }
    if spec.transfer.ib_devices:
        env["MOONCAKE_DEVICE"] = ",".join(spec.transfer.ib_devices)
    return env


def collective_env(spec: PDClusterSpec) -> dict[str, str]:
    """NCCL / NVSHMEM / Gloo: the HCAs of ``transfer.ibDevices``, the socket interface, the RoCE GID index.

    What the recipe leaves unset the worker image's entrypoint (``images/sglang-worker/entrypoint.sh``) finds on
    the node at start: no ``ibDevices`` with rdma, every RDMA device with an ACTIVE port (also ``NCCL_IB_HCA`` and
    ``NVSHMEM_HCA_LIST``); no ``socketInterface``, the interface that holds the pod's IP. Gloo takes only plain
    interface names, so an NCCL-only form (``^`` to exclude, ``=`` for exact names) leaves Gloo to the entrypoint.
    """
    transfer, env = spec.transfer, {}
    if transfer.protocol is TransferProtocol.RDMA and transfer.ib_devices:
        devices = ",".join(transfer.ib_devices)
        env["NCCL_IB_HCA"] = devices
        env["NVSHMEM_HCA_LIST"] = devices  # DeepEP's NVSHMEM uses only these HCAs
    if transfer.socket_interface:
        env["NCCL_SOCKET_IFNAME"] = transfer.socket_interface
        if not transfer.socket_interface.startswith(("^", "=")):
            env["GLOO_SOCKET_IFNAME"] = transfer.socket_interface
    if transfer.ib_gid_index is not None:
        env["NCCL_IB_GID_INDEX"] = env["NVSHMEM_IB_GID_INDEX"] = str(transfer.ib_gid_index)
    if spec.jit_cache.host_path:
        # SGLANG_CACHE_DIR redirects DeepGEMM, Triton, Inductor and FlashInfer; the two FlashInfer and Triton read
        # before SGLang can redirect them are set explicitly.
        env["SGLANG_CACHE_DIR"] = JIT_CACHE_DIR
        env["TRITON_CACHE_DIR"] = f"{JIT_CACHE_DIR}/triton"
        env["FLASHINFER_WORKSPACE_BASE"] = JIT_CACHE_DIR
    return env


def cache_volumes(spec: PDClusterSpec) -> tuple[list[dict[str, Any]], list[dict[str, Any]]]:
    """Host directories for the JIT cache and the node-local weights: (volumes, mounts)."""
    volumes: list[dict[str, Any]] = []
    mounts: list[dict[str, Any]] = []
    if spec.jit_cache.host_path:
        volumes.append(
            {"name": "jit-cache", "hostPath": {"path": spec.jit_cache.host_path, "type": "DirectoryOrCreate"}}
        )
        mounts.append({"name": "jit-cache", "mountPath": JIT_CACHE_DIR})
    cache = spec.model.weight_cache
    if cache is not None:
        # On the weight disk's nodes the directory must exist (a missing mount fails the pod instead of filling the
        # root disk); elsewhere it is created as before.
        kind = "Directory" if cache.node_label is not None else "DirectoryOrCreate"
        volumes.append({"name": "weights", "hostPath": {"path": cache.host_path, "type": kind}})
        mounts.append({"name": "weights", "mountPath": spec.model.mount_path})
    return volumes, mounts


PREFETCH_MARKER = ".tandem-complete"
# The marker names the repo and revision and is written (atomically) only after snapshot_download returned: a copy an
# interrupted download left behind (config.json comes early) is resumed, not loaded; another revision is fetched.
_PREFETCH = """
import os, sys
from huggingface_hub import snapshot_download
repo, target, revision = sys.argv[1], sys.argv[2], sys.argv[3]
marker, want = os.path.join(target, sys.argv[4]), repo + "@" + (revision or "default")
try:
    with open(marker) as f:
        done = f.read().strip() == want
except OSError:
    done = False
if not done:
    snapshot_download(repo, local_dir=target, revision=revision or None)
    with open(marker + ".tmp", "w") as f:
        f.write(want + "\\n")
    os.replace(marker + ".tmp", marker)
"""


def prefetch_containers(
    spec: PDClusterSpec, env: list[dict[str, Any]], requests: dict[str, str]
) -> list[dict[str, Any]]:
    """An init container that downloads the weights into the node-local cache when they are not there yet, with
    the worker's CPU and memory requests (a pod's request is the larger of its init and its main containers')."""
    cache = spec.model.weight_cache
    if cache is None or not cache.prefetch:
        return []
    revision = spec.model.revision or ""
    command = ["python3", "-c", _PREFETCH.strip(), cache.repo, spec.model.path, revision, PREFETCH_MARKER]
    return [
        {
            "name": PREFETCH_CONTAINER,
            "image": spec.images.worker,
            "imagePullPolicy": spec.images.pull_policy,
            "command": command,
            "env": [e for e in env if e["name"].startswith(("HF_", "HUGGING"))],
            "volumeMounts": [{"name": "weights", "mountPath": spec.model.mount_path}],
            "resources": {"requests": {k: v for k, v in requests.items() if k in ("cpu", "memory")}},
            "securityContext": init_security_context(),
        }
    ]


CACHED_NODE_WEIGHT = 100  # the scheduler normalises preferred weights anyway: the terms weigh the same


def cached_weights_affinity(spec: PDClusterSpec) -> dict[str, Any]:
    """A required node affinity for nodes labelled ``weightCache.nodeLabel`` (they hold the weight disk), and
    preferred ones for nodes that hold the weights already: those the operator labelled once a prefetch of this
    copy finished there (``naming.staged_label``) and those labelled ``model.cachedNodeLabel``; empty without them.
    Preferred terms only score the nodes every required rule allows, so the preference never overrides placement
    (one pod per node, ``topologyKey``, ``fabric``, ``nodeSelector``)."""
    affinity: dict[str, Any] = {}
    cache = spec.model.weight_cache
    if cache is not None and cache.node_label is not None:  # only nodes with the weight disk (weightCache.nodeLabel)
        disk = {"matchExpressions": [{"key": cache.node_label, "operator": "Exists"}]}
        affinity["requiredDuringSchedulingIgnoredDuringExecution"] = {"nodeSelectorTerms": [disk]}
    preferred = []
    staged = staged_label(spec)
    if staged is not None:
        match = {"matchExpressions": [{"key": staged, "operator": "In", "values": [STAGED_VALUE]}]}
        preferred.append({"weight": CACHED_NODE_WEIGHT, "preference": match})
    if spec.model.cached_node_label is not None:
        match = {"matchExpressions": [{"key": spec.model.cached_node_label, "operator": "Exists"}]}
        preferred.append({"weight": CACHED_NODE_WEIGHT, "preference": match})
    if preferred:
        affinity["preferredDuringSchedulingIgnoredDuringExecution"] = preferred
    return {"nodeAffinity": affinity} if affinity else {}


def gang_pod_fields(spec: PDClusterSpec, role: Role, group_name: str) -> dict[str, Any]:
    """Labels, annotations and schedulerName that put a pod into its group's gang."""
    gang, nodes = spec.scheduling, spec.role(role).nodes_per_group
    labels: dict[str, str] = {}
    annotations: dict[str, str] = {}
    if gang.pod_group == "kueue":
        labels[KUEUE_GROUP_LABEL] = group_name
        annotations[KUEUE_COUNT_ANNOTATION] = str(nodes)
    elif gang.pod_group == "volcano":
        annotations[VOLCANO_GROUP_ANNOTATION] = group_name
    elif gang.pod_group == "scheduler-plugins":
        labels[COSCHEDULING_LABEL] = group_name
    return {"labels": labels, "annotations": annotations, "schedulerName": gang.scheduler_name}


def group_objects(
    spec: PDClusterSpec, role: Role, metadata: dict[str, Any], selector: dict[str, str]
) -> list[dict[str, Any]]:
    """The group's PodDisruptionBudget (no voluntary eviction of any member: one lost rank breaks the whole
    group; a drained node's groups are moved by the operator when it sees the cordon, and the eviction of a pod it
    is deleting goes through) and, for Volcano or scheduler-plugins, its PodGroup (all ``nodesPerGroup`` pods or
    none)."""
    objects: list[dict[str, Any]] = [
        {
            "apiVersion": "policy/v1",
            "kind": "PodDisruptionBudget",
            "metadata": metadata,
            "spec": {"maxUnavailable": 0, "selector": {"matchLabels": selector}},
        }
    ]
    api = PODGROUP_API.get(spec.scheduling.pod_group)
    if api is not None:
        nodes = spec.role(role).nodes_per_group
        objects.append({"apiVersion": api, "kind": "PodGroup", "metadata": metadata, "spec": {"minMember": nodes}})
    return objects
