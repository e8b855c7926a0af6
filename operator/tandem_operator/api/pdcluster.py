"""The ``PDCluster`` resource (short name ``pdc``): one prefill/decode-disaggregated deployment of a model.

Replicas have exactly one source of truth at a time:

* ``spec.prefill.groups`` / ``spec.decode.groups`` are **initial values only**. The operator uses them when it
  creates the role's ``PDPool`` and never again; the API server rejects later changes to them (CEL transition
  rule), with a message that says to scale the pool instead.
* After creation ``PDPool.spec.replicas`` is authoritative: ``kubectl scale pdpool/<cluster>-decode
  --replicas=N`` and HPAs write it through the scale subresource, and the operator's own applies of the pool
  carry the value it read from the live pool, so the cluster and the pools never fight over it.

Everything else about a role (parallelism, images, transfer, placement) comes from the PDCluster only.
"""

from __future__ import annotations

import re
from collections.abc import Callable
from enum import StrEnum
from typing import Annotated, Any, ClassVar, Literal

from pydantic import Field, StringConstraints

from tandem.registry import Role
from tandem_operator.api.autoscaling import AutoscalingSpec, AutoscalingStatus
from tandem_operator.api.common import (
    CONDITIONS_LIST,
    Condition,
    EnvVar,
    LabelKey,
    LabelValue,
    PortSet,
    Quantity,
    Resources,
    Toleration,
)
from tandem_operator.api.fabric import HOSTNAME_LABEL, FabricSpec, QualifiedLabelKey
from tandem_operator.api.lifecycle import LifecycleSpec
from tandem_operator.api.mooncake_ports import (
    EPHEMERAL_PORTS,
    MOONCAKE_MIN_PORT,
    VALID_RANGES,
    ports_needed,
    ports_needed_cel,
)
from tandem_operator.api.recipe import (
    GangSchedulingSpec,
    HiCacheSpec,
    HostKvCacheSpec,
    JitCacheSpec,
    PeerLoadingSpec,
    SpeculativeSpec,
    WeightCacheSpec,
    WeightsStatus,
    host_cache_rules,
)
from tandem_operator.api.rules import CrdModel, Rule, immutable
from tandem_operator.api.transfer import TransferProtocol as TransferProtocol
from tandem_operator.api.transfer import TransferSpec as TransferSpec
from tandem_operator.api.upgrade import UpgradePolicy

# Flags the operator computes from the spec; extraArgs may not set them (they would silently fight).
MANAGED_FLAGS = (
    "--model-path",
    "--served-model-name",
    "--page-size",
    "--max-running-requests",
    "--cuda-graph-max-bs-decode",
    "--revision",
    "--host",
    "--port",
    "--tp-size",
    "--ep-size",
    "--attn-dp-size",
    "--dp-size",
    "--enable-dp-attention",
    "--nnodes",
    "--node-rank",
    "--dist-init-addr",
    "--disaggregation-mode",
    "--disaggregation-transfer-backend",
    "--disaggregation-bootstrap-port",
    "--disaggregation-ib-device",
    "--moe-a2a-backend",
    "--deepep-mode",
    "--hicache-storage-backend",
    "--disaggregation-decode-enable-offload-kvcache",
    "--enable-hierarchical-cache",
    "--hicache-size",
    "--speculative-algorithm",
    "--speculative-draft-model-path",
    "--load-format",
    "--remote-instance-weight-loader-backend",
    "--remote-instance-weight-loader-seed-instance-ip",
    "--remote-instance-weight-loader-seed-instance-service-port",
    "--remote-instance-weight-loader-start-seed-via-transfer-engine",
)
_MANAGED_CEL = "[" + ", ".join(f"'{flag}'" for flag in MANAGED_FLAGS) + "]"

# Child names are "<cluster>-<role>-<group>-<rank>" (pods) and "<cluster>-<role>-<group>" (Services, DNS labels
# of at most 63 characters): "-prefill-999-63" adds 15 characters, so 48 keeps every name valid.
MAX_CLUSTER_NAME = 48
_DNS_LABEL = r"^[a-z]([-a-z0-9]*[a-z0-9])?$"
# Rules on the whole object (``self`` is the PDCluster; ``check`` gets its name).
CLUSTER_NAME_RULES = (
    Rule(
        cel=f"self.metadata.name.matches('{_DNS_LABEL}')",
        message="metadata.name must be a DNS label (lowercase letters, digits, '-'): Services derive from it",
        check=lambda name: re.fullmatch(_DNS_LABEL, name) is not None,
    ),
    Rule(
        cel=f"self.metadata.name.size() <= {MAX_CLUSTER_NAME}",
        message=f"metadata.name must be at most {MAX_CLUSTER_NAME} characters (pod and Service names derive from it)",
        check=lambda name: len(name) <= MAX_CLUSTER_NAME,
    ),
)

ExtraArg = Annotated[str, StringConstraints(min_length=1, max_length=256)]
EtcdEndpoint = Annotated[str, StringConstraints(pattern=r"^https?://[^/\s]+$", max_length=253)]
PlainEtcdEndpoint = Annotated[str, StringConstraints(pattern=r"^http://[^/\s]+$", max_length=253)]


class DeepEPMode(StrEnum):
    NORMAL = "normal"
    LOW_LATENCY = "low_latency"
    AUTO = "auto"


class ModelSpec(CrdModel):
    """What the workers serve. Defaults: Kimi K2.6 with its tool-call and reasoning parsers."""

    path: str = Field(
        default="moonshotai/Kimi-K2.6", min_length=1, max_length=1024, description="--model-path, passed verbatim."
    )
    served_name: str = Field(default="kimi-k2.6", min_length=1, max_length=253, description="--served-model-name.")
    revision: str | None = Field(default=None, max_length=253, description="Hugging Face revision (--revision).")
    trust_remote_code: bool = True
    tool_call_parser: str | None = Field(default="kimi_k2", max_length=64)
    reasoning_parser: str | None = Field(default="kimi_k2", max_length=64)
    pvc: str | None = Field(
        default=None,
        max_length=253,
        description="PersistentVolumeClaim holding the weights, mounted read-only at mountPath (point path at it).",
    )
    mount_path: str = Field(default="/models", pattern=r"^/", max_length=1024)
    context_length: int | None = Field(default=None, ge=1, le=4194304, description="--context-length.")
    speculative: SpeculativeSpec = Field(default_factory=SpeculativeSpec, description="EAGLE3 speculative decoding.")
    weight_cache: WeightCacheSpec | None = Field(
        default=None, description="Node-local weights (hostPath, prefetched); path then names the copy in it."
    )
    cached_node_label: QualifiedLabelKey | None = Field(
        default=None,
        description="A node label that marks nodes already holding this model's weights (set by whatever stages "
        "them outside the operator, e.g. a prefetch DaemonSet; name one label per model; with weightCache.prefetch "
        "the operator labels the nodes it staged itself, status.weights.nodeLabel): worker pods prefer such nodes "
        "(a preferred node affinity, weight 100, so it ranks nodes that every required rule already allows and "
        "never overrides one). A recreated group or an in-place rollout (maxSurgeGroups: 0) then lands where the "
        "load is a local read. Changing it rolls no pod: it applies to pods created from then on.",
    )
    moe_quantization: Literal["w4a16", "fp8", "bf16"] | None = Field(
        default=None,
        description="The checkpoint's MoE weights, for the checks that depend on them: w4a16 (Kimi K2.6's INT4, "
        "compressed-tensors run by Marlin) takes only SGLang 0.5.23's standard dispatch "
        "(CompressedTensorsWNA16MoE.apply_weights), so no DeepEP and no group over several nodes.",
    )

    cel_rules = (
        Rule(
            cel="!has(self.weightCache) || !has(self.pvc)",
            message="model.weightCache and model.pvc both mount at mountPath: use one",
            check=lambda s: s.weight_cache is None or s.pvc is None,
            field_path=".weightCache",
        ),
        Rule(
            cel="!has(self.weightCache) || !has(self.weightCache.nodeLabel) || !self.weightCache.prefetch || "
            "(has(self.revision) && self.revision.matches('^[0-9a-f]{40}$'))",
            message="model.revision must pin a commit (40 hex digits) when weightCache.nodeLabel stages the weights "
            "on the labelled nodes from the hub (weightCache.prefetch): a branch or no revision lets nodes hold "
            "different snapshots",
            check=lambda s: (
                s.weight_cache is None
                or s.weight_cache.node_label is None
                or not s.weight_cache.prefetch
                or (s.revision is not None and re.fullmatch(r"[0-9a-f]{40}", s.revision) is not None)
            ),
            field_path=".revision",
        ),
        Rule(
            cel="!has(self.weightCache) || self.path.startsWith(self.mountPath + '/')",
            message="with weightCache, path must be the local copy under mountPath (e.g. /models/Kimi-K2.6)",
            check=lambda s: s.weight_cache is None or s.path.startswith(s.mount_path + "/"),
            field_path=".path",
        ),
    )


class ImagesSpec(CrdModel):
    """Container images."""

    worker: str = Field(default="lmsysorg/sglang:v0.5.23", min_length=1, max_length=1024)
    pull_policy: Literal["Always", "IfNotPresent", "Never"] = "IfNotPresent"
    pull_secrets: list[Annotated[str, StringConstraints(max_length=253)]] = Field(default_factory=list, max_length=8)


class PoolSpec(CrdModel):
    """One role's groups. A group is one SGLang server spread over ``nodesPerGroup`` pods, one pod per node."""

    groups: int = Field(
        default=1,
        ge=0,
        le=1000,
        description="Initial number of groups, used only when the role's PDPool is created; afterwards scale the "
        "PDPool (kubectl scale pdpool/<cluster>-<role>).",
        json_schema_extra=immutable(
            "groups only sets the initial size; scale the PDPool instead: kubectl scale pdpool/<cluster>-<role>"
        ),
    )
    nodes_per_group: int = Field(default=1, ge=1, le=64, description="Pods (= nodes) per group (--nnodes).")
    gpus_per_node: int = Field(default=8, ge=1, le=16, description="nvidia.com/gpu requested by each pod.")
    tp_size: int = Field(default=8, ge=1, le=1024, description="--tp-size over the whole group.")
    ep_size: int = Field(default=8, ge=1, le=1024, description="--ep-size (expert parallelism).")
    attn_dp_size: int = Field(default=1, ge=1, le=1024, description="--attn-dp-size (attention data parallelism).")
    moe_a2a_backend: Literal["deepep", "none"] = Field(
        default="none",
        description="MoE all-to-all: none (SGLang's standard dispatch; the only one Kimi K2.6's INT4 W4A16 Marlin "
        "MoE takes in SGLang 0.5.23) or deepep (FP8/BF16 checkpoints).",
    )
    deepep_mode: DeepEPMode = DeepEPMode.AUTO
    enable_eplb: bool = False
    ep_num_redundant_experts: int = Field(default=0, ge=0, le=1024)
    moe_dense_tp_size: Literal[1] | None = None
    enable_dp_lm_head: bool = False
    enable_two_batch_overlap: bool = False
    chunked_prefill_size: int | None = Field(
        default=None,
        ge=1,
        description="Chunked-prefill tokens per attention-DP rank: the operator passes this x attnDpSize, since "
        "SGLang divides --chunked-prefill-size by attn_dp_size (sglang/srt/arg_groups/parallel_hook.py).",
    )
    mem_fraction_static: float | None = Field(default=None, gt=0, lt=1)
    extra_args: list[ExtraArg] = Field(
        default_factory=list, max_length=64, description="Appended to the SGLang command line verbatim."
    )
    env: list[EnvVar] = Field(default_factory=list, max_length=64)
    resources: Resources = Field(default_factory=Resources)
    node_selector: dict[str, LabelValue] = Field(default_factory=dict, max_length=32)
    tolerations: list[Toleration] = Field(default_factory=list, max_length=32)
    topology_key: LabelKey | None = Field(
        default=None,
        description="Node label (rack, NVLink/IB block) all pods of a group must share with the group leader.",
    )
    shm_size: Quantity = Field(default="64Gi", description="Size of the memory-backed /dev/shm.")
    node_memory_gib: int | None = Field(
        default=None,
        ge=1,
        le=65536,
        description="Memory of the role's nodes: the host KV cache of every rank on a node must fit it.",
    )
    max_surge_groups: int = Field(
        default=1,
        ge=0,
        le=1,
        description="Extra groups a rollout may create before deleting an old one. 1 (surge): a new group first, "
        "an old one retired once it is Ready; needs a spare node set per role (without one the new group stays "
        "Pending until lifecycle.startDeadlineSeconds, then is recreated, Pending again). 0 (in place): one old "
        "group is drained and deleted and its replacement takes the freed nodes; no spare nodes, one group less "
        "capacity during each step, and with more than one group per role the last old-revision group still waits "
        "until routers can pair the new revision.",
    )

    @property
    def attn_tp_size(self) -> int:
        """Tensor-parallel ranks of one attention-DP replica (SGLang's ``attn_tp_size``)."""
        return self.tp_size // self.attn_dp_size

    cel_rules: ClassVar[tuple[Rule, ...]] = (
        Rule(
            cel="self.tpSize == self.nodesPerGroup * self.gpusPerNode",
            message="tpSize must equal nodesPerGroup * gpusPerNode (one tensor-parallel rank per GPU)",
            check=lambda s: s.tp_size == s.nodes_per_group * s.gpus_per_node,
            field_path=".tpSize",
        ),
        Rule(
            cel="self.tpSize % self.epSize == 0",
            message="epSize must divide tpSize",
            check=lambda s: s.tp_size % s.ep_size == 0,
            field_path=".epSize",
        ),
        Rule(
            cel="self.tpSize % self.attnDpSize == 0",
            message="attnDpSize must divide tpSize",
            check=lambda s: s.tp_size % s.attn_dp_size == 0,
            field_path=".attnDpSize",
        ),
        Rule(
            cel="self.moeA2ABackend != 'deepep' || self.epSize == self.tpSize",
            message="moeA2ABackend deepep needs epSize == tpSize",
            check=lambda s: s.moe_a2a_backend != "deepep" or s.ep_size == s.tp_size,
            field_path=".epSize",
        ),
        Rule(
            cel="!self.enableEplb || self.epSize > 1",
            message="enableEplb needs epSize > 1 (SGLang asserts it: parallel_hook.handle_eplb_and_dispatch)",
            check=lambda s: not s.enable_eplb or s.ep_size > 1,
            field_path=".enableEplb",
        ),
        Rule(
            cel="!self.enableDpLmHead || self.attnDpSize > 1",
            message="enableDpLmHead needs attnDpSize > 1",
            check=lambda s: not s.enable_dp_lm_head or s.attn_dp_size > 1,
            field_path=".enableDpLmHead",
        ),
        Rule(
            cel="!has(self.extraArgs) || "
            f"self.extraArgs.all(a, !{_MANAGED_CEL}.exists(f, a == f || a.startsWith(f + '=')))",
            message="extraArgs may not set flags the operator manages: " + " ".join(MANAGED_FLAGS),
            check=lambda s: not any(a == f or a.startswith(f + "=") for a in s.extra_args for f in MANAGED_FLAGS),
            field_path=".extraArgs",
        ),
    )


def _prefill_ports() -> PortSet:
    return PortSet(http=30000, bootstrap=8998, dist_init=5000, mooncake_rpc=15000)


def _decode_ports() -> PortSet:
    return PortSet(http=30001, bootstrap=9008, dist_init=5001, mooncake_rpc=15100)  # above prefill's 32 ports


_HOST_MEMORY_MESSAGE = (
    "host KV cache per node ((hostMemoryGib + mooncakeStore.globalSegmentGib) x gpusPerNode ranks) must fit "
    "nodeMemoryGib"
)


class PrefillSpec(PoolSpec):
    """Prefill groups: DeepEP normal mode (throughput); their leaders run the PD bootstrap server."""

    deepep_mode: DeepEPMode = DeepEPMode.NORMAL
    ports: PortSet = Field(default_factory=_prefill_ports, json_schema_extra={"default": _prefill_ports().to_wire()})
    hicache: HiCacheSpec = Field(default_factory=HiCacheSpec, description="HiCache + Mooncake Store (PD: prefill).")

    cel_rules: ClassVar[tuple[Rule, ...]] = (
        *PoolSpec.cel_rules,
        Rule(
            cel="!has(self.nodeMemoryGib) || !self.hicache.enabled || (self.hicache.hostMemoryGib + "
            "(has(self.hicache.mooncakeStore) ? self.hicache.mooncakeStore.globalSegmentGib : 0)) * self.gpusPerNode"
            " <= self.nodeMemoryGib",
            message=_HOST_MEMORY_MESSAGE,
            check=lambda s: (
                s.node_memory_gib is None or s.hicache.host_gib_per_rank() * s.gpus_per_node <= s.node_memory_gib
            ),
            field_path=".hicache.hostMemoryGib",
        ),
    )


class KvOffloadSpec(HostKvCacheSpec):
    """Decode KV-cache offload to host memory and a HiCache storage backend."""

    cel_rules = host_cache_rules("kvOffload")


class DecodeSpec(PoolSpec):
    """Decode groups: DeepEP low-latency mode; optionally offload KV to Mooncake Store."""

    deepep_mode: DeepEPMode = DeepEPMode.LOW_LATENCY
    ports: PortSet = Field(default_factory=_decode_ports, json_schema_extra={"default": _decode_ports().to_wire()})
    kv_offload: KvOffloadSpec = Field(default_factory=KvOffloadSpec)
    max_running_requests: int | None = Field(
        default=None,
        ge=1,
        le=1 << 20,
        description="--max-running-requests of the whole decode server; the operator also passes "
        "--cuda-graph-max-bs-decode = maxRunningRequests / attnDpSize, the batch of one attention-DP rank (SGLang "
        "caps each rank's decode graphs at max_running_requests // attn_dp_size, moe_hook.py). Unset: SGLang's own.",
    )

    cel_rules: ClassVar[tuple[Rule, ...]] = (
        *PoolSpec.cel_rules,
        Rule(
            cel="!has(self.maxRunningRequests) || self.maxRunningRequests % self.attnDpSize == 0",
            message="maxRunningRequests must be a multiple of attnDpSize (each attention-DP rank runs an equal share)",
            check=lambda s: s.max_running_requests is None or s.max_running_requests % s.attn_dp_size == 0,
            field_path=".maxRunningRequests",
        ),
    )


class RouterSpec(CrdModel):
    """Settings for the Tandem routers that serve this cluster."""

    # The router's selection policies (tandem_router.policy.selection.Policy; a test keeps them equal).
    policy: Literal["round_robin", "power_of_two", "cache_aware", "random"] = Field(
        default="cache_aware", description="How the router picks a prefill/decode pair (cache_aware: prefix affinity)."
    )
    max_attempts: int = Field(default=5, ge=1, le=10, description="Tries per request before its first byte.")
    pair_same_revision: bool = Field(default=True, description="Pair only prefill and decode of one revision.")


class EtcdSpec(CrdModel):
    """The etcd the endpoint registry (and, unless ``mooncakeEndpoints`` names another, Mooncake's metadata and
    master HA) lives in."""

    endpoints: list[EtcdEndpoint] = Field(min_length=1, max_length=16)
    mooncake_endpoints: list[PlainEtcdEndpoint] = Field(
        default_factory=list,
        max_length=16,
        description="The etcd of Mooncake's own keys (Transfer Engine metadata, Mooncake Store master HA, the "
        "stale entries the operator removes after a fence) when it is not the registry's. Mooncake's etcd client "
        "speaks plaintext without a user (mooncake-common/etcd/etcd_wrapper.go), so a registry etcd with TLS and "
        "client certificates needs one. Empty: endpoints.",
    )

    @property
    def mooncake(self) -> list[str]:
        """Where Mooncake's keys live."""
        return list(self.mooncake_endpoints or self.endpoints)


def _w4a16_fits(role: Role) -> Callable[[Any], bool]:
    def fits(spec: Any) -> bool:
        pool = spec.role(role)
        return bool(
            spec.model.moe_quantization != "w4a16" or (pool.moe_a2a_backend == "none" and pool.nodes_per_group == 1)
        )

    return fits


def _fixed_ports_outside_range(role: Role) -> Callable[[Any], bool]:
    return lambda spec: not set(spec.role(role).ports.fixed()) & set(spec.declared_range(role))


def _range_holds_a_window(role: Role) -> Callable[[Any], bool]:
    return lambda spec: len(spec.declared_range(role)) >= len(spec.mooncake_range(role))


def _range_valid_for_mooncake(role: Role) -> Callable[[Any], bool]:
    def valid(spec: Any) -> bool:
        ports: range = spec.declared_range(role)
        return (
            ports.start >= MOONCAKE_MIN_PORT
            and ports.stop - 1 <= 65535
            and (ports.stop - 1 < EPHEMERAL_PORTS[0] or ports.start > EPHEMERAL_PORTS[1])
        )

    return valid


STORE_PAGE_SIZE = 64
STORE_CEL = {"prefill": "self.prefill.hicache.enabled", "decode": "self.decode.kvOffload.enabled"}


def _size_cel(role: str) -> str:
    return ports_needed_cel(
        f"self.{role}.gpusPerNode", "self.transfer.protocol", STORE_CEL[role], "self.peerLoading.enabled"
    )


def _all_ports_cel(role: str) -> str:
    """The role's fixed ports and the two ends of its bootstrap and declared Mooncake ranges (ranges overlap only if
    an end is inside)."""
    ports = f"self.{role}.ports"
    last = f"{ports}.mooncakeRpc + {ports}.mooncakePorts - 1"
    last_bootstrap = f"{ports}.bootstrap + {ports}.bootstrapPorts - 1"
    return f"[{ports}.http, {ports}.bootstrap, {last_bootstrap}, {ports}.distInit, {ports}.mooncakeRpc, {last}]"


def _in_role_cel(role: str, port: str) -> str:
    ports = f"self.{role}.ports"
    return (
        f"{port} == {ports}.http || {port} == {ports}.distInit || "
        f"({port} >= {ports}.bootstrap && {port} < {ports}.bootstrap + {ports}.bootstrapPorts) || "
        f"({port} >= {ports}.mooncakeRpc && {port} < {ports}.mooncakeRpc + {ports}.mooncakePorts)"
    )


class PDClusterSpec(CrdModel):
    """Desired state of a prefill/decode-disaggregated deployment."""

    model: ModelSpec = Field(default_factory=ModelSpec)
    images: ImagesSpec = Field(default_factory=ImagesSpec)
    prefill: PrefillSpec = Field(default_factory=PrefillSpec)
    decode: DecodeSpec = Field(default_factory=DecodeSpec)
    transfer: TransferSpec
    router: RouterSpec = Field(default_factory=RouterSpec)
    etcd: EtcdSpec
    lifecycle: LifecycleSpec = Field(default_factory=LifecycleSpec)
    jit_cache: JitCacheSpec = Field(default_factory=JitCacheSpec)
    scheduling: GangSchedulingSpec = Field(default_factory=GangSchedulingSpec)
    peer_loading: PeerLoadingSpec = Field(
        default_factory=PeerLoadingSpec,
        description="Groups created whole load their weights from a serving peer over Mooncake (SGLang's "
        "remote-instance loader) when one is free, else from the node's copy.",
    )
    page_size: int | None = Field(
        default=None,
        ge=1,
        le=4096,
        description="--page-size of both roles (tokens per KV page; one value, since a prefill and a decode whose "
        "page sizes differ cannot exchange KV). Unset: 64 when a role uses a Mooncake Store (MLA on Hopper defaults "
        "to 1, one Store key per token; upstream's PD + HiCache example passes 64 to both), else SGLang's default.",
    )
    deterministic_inference: bool = Field(
        default=False,
        description="--enable-deterministic-inference on both roles: batch-invariant kernels, so a temperature-0 "
        "answer does not depend on the batch around it and a resumed stream continues token for token. Off (SGLang's "
        "default): near-tied tokens can flip with the batch size, and the router's integrity checks tell such "
        "flips from corruption by their logprobs. Cost: SGLang publishes a 34.35% overhead with CUDA graphs (LMSYS, "
        "2025-09-22); on Hopper with no --attention-backend SGLang picks fa3, which keeps the radix cache, and with "
        "tp > 1 it forces NCCL's tree all-reduce and turns custom all-reduce off.",
    )
    autoscaling: AutoscalingSpec | None = Field(
        default=None,
        description="SLO-driven autoscaling: when set, the operator owns both PDPools' replicas (a kubectl scale "
        "is only a new starting point that later decisions move; do not add an HPA).",
    )
    fabric: FabricSpec | None = Field(
        default=None,
        description="The nodes' RDMA fabric domains: each group's pods stay inside one, its registry entry names "
        "it, and routers pair a prefill and a decode of one domain (fabric.mode). Unset: no placement rule, and "
        "routers pair across domains freely.",
    )

    upgrade_policy: UpgradePolicy = Field(
        default_factory=UpgradePolicy,
        description="When groups whose pods differ from what this operator renders, the spec unchanged (an operator "
        "upgrade), are rolled; a spec change that changes the pods rolls at once whatever it says.",
    )

    cel_rules = (
        *(
            rule
            for role in ("prefill", "decode")
            for rule in (
                Rule(
                    cel=f"!has(self.model.moeQuantization) || self.model.moeQuantization != 'w4a16' || "
                    f"(self.{role}.moeA2ABackend == 'none' && self.{role}.nodesPerGroup == 1)",
                    message=f"{role}: model.moeQuantization w4a16 (Marlin MoE) takes only SGLang 0.5.23's standard "
                    "dispatch: moeA2ABackend none and nodesPerGroup 1 (the MoE traffic of a group over several nodes "
                    "would cross them over IB on every layer)",
                    check=_w4a16_fits(Role(role)),
                    field_path=f".{role}.nodesPerGroup",
                ),
                Rule(
                    cel=f"[self.{role}.ports.http, self.{role}.ports.bootstrap, self.{role}.ports.bootstrap + "
                    f"self.{role}.ports.bootstrapPorts - 1, self.{role}.ports.distInit].all(p, "
                    f"p < self.{role}.ports.mooncakeRpc || p >= self.{role}.ports.mooncakeRpc + "
                    f"self.{role}.ports.mooncakePorts)",
                    message=f"{role}.ports: http, the bootstrap range and distInit must lie outside the Mooncake range "
                    "[mooncakeRpc, mooncakeRpc + mooncakePorts - 1]",
                    check=_fixed_ports_outside_range(Role(role)),
                    field_path=f".{role}.ports",
                ),
                Rule(
                    cel=f"self.{role}.ports.mooncakePorts >= {_size_cel(role)}",
                    message=f"{role}.ports.mooncakePorts must hold one pod's window: gpusPerNode x (2 with tcp, "
                    "else 1) ports, one Mooncake engine per GPU rank (two with a Mooncake Store over tcp, one more "
                    "with peerLoading.enabled)",
                    check=_range_holds_a_window(Role(role)),
                    field_path=f".{role}.ports.mooncakePorts",
                ),
                Rule(
                    cel=f"self.{role}.ports.mooncakeRpc >= {MOONCAKE_MIN_PORT} && "
                    f"self.{role}.ports.mooncakeRpc + self.{role}.ports.mooncakePorts - 1 <= 65535 && "
                    f"(self.{role}.ports.mooncakeRpc + self.{role}.ports.mooncakePorts - 1 < {EPHEMERAL_PORTS[0]} || "
                    f"self.{role}.ports.mooncakeRpc > {EPHEMERAL_PORTS[1]})",
                    message=f"{role}.ports: the Mooncake range [mooncakeRpc, mooncakeRpc + mooncakePorts - 1] must "
                    f"lie within {VALID_RANGES} (Mooncake ignores a range that touches the ephemeral ports and falls "
                    "back to [15000, 17000])",
                    check=_range_valid_for_mooncake(Role(role)),
                    field_path=f".{role}.ports.mooncakeRpc",
                ),
            )
        ),
        Rule(
            cel="!self.transfer.hostNetwork || ("
            f"{_all_ports_cel('prefill')}.all(p, !({_in_role_cel('decode', 'p')})) && "
            f"{_all_ports_cel('decode')}.all(p, !({_in_role_cel('prefill', 'p')})))",
            message="with transfer.hostNetwork, prefill.ports and decode.ports (Mooncake ranges included) must not "
            "share a port",
            check=lambda s: not s.transfer.host_network or not s.role_ports(Role.PREFILL) & s.role_ports(Role.DECODE),
            field_path=".decode.ports",
        ),
        Rule(
            cel="!(self.prefill.hicache.enabled || self.decode.kvOffload.enabled) || "
            "!self.etcd.endpoints.exists(e, e.startsWith('https://')) || "
            "(has(self.etcd.mooncakeEndpoints) && size(self.etcd.mooncakeEndpoints) > 0)",
            message="etcd.mooncakeEndpoints: a Mooncake Store (prefill.hicache, decode.kvOffload) cannot use an "
            "https:// registry etcd (Mooncake's etcd client has no TLS); name a plaintext etcd for Mooncake, e.g. "
            "the chart's <release>-mooncake-etcd (helm status prints it)",
            check=lambda s: (
                not (s.prefill.hicache.enabled or s.decode.kv_offload.enabled)
                or not any(e.startswith("https://") for e in s.etcd.endpoints)
                or bool(s.etcd.mooncake_endpoints)
            ),
            field_path=".etcd.mooncakeEndpoints",
        ),
        Rule(
            cel=f"!has(self.fabric) || self.fabric.domainLabel != '{HOSTNAME_LABEL}' || "
            "(self.prefill.nodesPerGroup == 1 && self.decode.nodesPerGroup == 1)",
            message=f"fabric.domainLabel {HOSTNAME_LABEL} makes a node its own domain, which a group over several "
            "nodes cannot fit in: name the label of a rack, rail group or NVLink domain, or use nodesPerGroup 1",
            check=lambda s: (
                s.fabric is None
                or s.fabric.domain_label != HOSTNAME_LABEL
                or (s.prefill.nodes_per_group == 1 and s.decode.nodes_per_group == 1)
            ),
            field_path=".fabric.domainLabel",
        ),
    )

    def mooncake_range(self, role: Role) -> range:
        """The role's ``[MC_MIN_RPC_PORT, MC_MAX_RPC_PORT]`` at epoch 0 (one pod window): every rank of a pod gets its
        ports."""
        spec = self.role(role)
        needed = ports_needed(
            spec.gpus_per_node, self.transfer.protocol, self.has_store(role), self.peer_loading.enabled
        )
        return range(spec.ports.mooncake_rpc, spec.ports.mooncake_rpc + needed)

    def effective_page_size(self) -> int | None:
        """``--page-size`` for both roles: ``pageSize``, else 64 with a Mooncake Store, else SGLang's own."""
        if self.page_size is not None:
            return self.page_size
        return STORE_PAGE_SIZE if self.has_store(Role.PREFILL) or self.has_store(Role.DECODE) else None

    def has_store(self, role: Role) -> bool:
        """The role's ranks open a Mooncake Store: prefill HiCache, or decode KV offload."""
        return self.prefill.hicache.enabled if role is Role.PREFILL else self.decode.kv_offload.enabled

    def declared_range(self, role: Role) -> range:
        """The role's declared Mooncake range: the pod windows of successive epochs move through it."""
        ports = self.role(role).ports
        return range(ports.mooncake_rpc, ports.mooncake_rpc + ports.mooncake_ports)

    def role_ports(self, role: Role) -> set[int]:
        """Every port a pod of the role may listen on, whatever its epoch."""
        return {*self.role(role).ports.fixed(), *self.declared_range(role)}

    def role(self, role: Role) -> PrefillSpec | DecodeSpec:
        return self.prefill if role is Role.PREFILL else self.decode


class Phase(StrEnum):
    PENDING = "Pending"
    PROGRESSING = "Progressing"
    READY = "Ready"
    DEGRADED = "Degraded"


class RoleStatus(CrdModel):
    """Observed groups of one role."""

    groups: int = Field(default=0, ge=0, description="Desired groups (the PDPool's replicas).")
    ready_groups: int = Field(default=0, ge=0, description="Groups whose every pod is Ready.")
    updated_groups: int = Field(default=0, ge=0, description="Groups running the current template.")
    recovering_groups: int = Field(default=0, ge=0, description="Groups being recreated after a member died.")
    template_hash: str = ""


class PDClusterStatus(CrdModel):
    """Observed state, written by the operator."""

    observed_generation: int = Field(default=0, ge=0)
    phase: Phase = Phase.PENDING
    revision: str = Field(default="", description="Compatibility revision: routers pair equal revisions only.")
    conditions: list[Condition] = Field(
        default_factory=list,
        max_length=16,
        json_schema_extra=CONDITIONS_LIST,
        description="Ready (a prefill and a decode group serve), Progressing (groups being created, scaled or "
        "rolled), Degraded (groups recreated after a member died), IntegrityDegraded (live routers quarantined "
        "prefill/decode pairs for garbled output; the message names them and why), PodsOutdated (groups whose pods "
        "differ from what this operator renders with the spec unchanged, held or rolled per spec.upgradePolicy; the "
        "message names the roles and the image, flags and env that differ).",
    )
    prefill: RoleStatus = Field(default_factory=RoleStatus)
    decode: RoleStatus = Field(default_factory=RoleStatus)
    recoveries: int = Field(default=0, ge=0, description="Groups recreated after a member died.")
    last_recovery_seconds: float | None = Field(
        default=None, ge=0, description="From the death of a member to its group registered again."
    )
    autoscaling: AutoscalingStatus | None = Field(default=None, description="The autoscaler's last decision.")
    weights: WeightsStatus | None = Field(
        default=None, description="The nodes holding the staged weights (with model.weightCache.prefetch)."
    )
