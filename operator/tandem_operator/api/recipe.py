"""Parts of the Kimi K2.6 recipe (SGLang's K2.6 deployment cookbook, Mooncake's SGLang HiCache guide for PD).

* ``SpeculativeSpec``: EAGLE3 with the cookbook's draft model and step sizes (``--speculative-*``).
* ``HiCacheSpec``: HiCache with the Mooncake Store on the **prefill** workers, as Mooncake's PD guide places it
  (decode offload writes only the increment decode generated, which only a prefill reads back). Its host memory
  per rank (``--hicache-size`` plus the store segment) times the ranks per node must fit ``nodeMemoryGib``.
* ``JitCacheSpec``: a host directory for SGLang's JIT caches (``SGLANG_CACHE_DIR``: DeepGEMM, Triton, FlashInfer,
  Inductor; ``sglang/srt/environ.py`` ``third_party_cache_defaults``), so a recreated group does not recompile.
* ``WeightCacheSpec``: a node-local copy of the weights (hostPath), filled by a prefetch init container;
  ``WeightsStatus``: the nodes that hold it.
* ``PeerLoadingSpec``: a recreated or added group pulls its weights from a serving group of its role over Mooncake
  (SGLang's remote-instance loader, ``transfer_engine`` backend) instead of reading the node's copy.
* ``GangSchedulingSpec``: a scheduler name and a PodGroup per group (Volcano, scheduler-plugins coscheduling) or
  Kueue's pod-group labels, so a group's pods are placed all together or not at all.
"""

from __future__ import annotations

from typing import Literal

from pydantic import Field

from tandem_operator.api.fabric import QualifiedLabelKey
from tandem_operator.api.rules import CrdModel, Rule


class MooncakeStoreSpec(CrdModel):
    """The Mooncake Store behind HiCache's L3 (prefill HiCache; decode offload)."""

    master_ha: bool = Field(
        default=True,
        description="Find the master through etcd (Mooncake master HA, leader elected on the cluster's etcd).",
    )
    master_address: str | None = Field(default=None, max_length=253, description="host:port of a single master.")
    global_segment_gib: int = Field(
        default=0,
        ge=0,
        le=4096,
        description="GiB each rank contributes to the store (0: a pure client). SGLang divides "
        "MOONCAKE_GLOBAL_SEGMENT_SIZE by the attention-TP size per rank; the operator multiplies it back.",
    )
    cluster_id: str = Field(
        default="tandem",
        pattern=r"^[A-Za-z0-9_.-]+$",
        max_length=128,
        description="MC_STORE_CLUSTER_ID: must equal the master's --cluster_id (the chart's mooncakeMaster.clusterId, "
        "default tandem); a client under another id finds no master.",
    )

    cel_rules = (
        Rule(
            cel="self.masterHa || has(self.masterAddress)",
            message="mooncakeStore needs masterHa: true or a masterAddress",
            check=lambda s: s.master_ha or s.master_address is not None,
            field_path=".masterAddress",
        ),
    )


class HostKvCacheSpec(CrdModel):
    """A host KV cache per rank (``--hicache-size``) with an optional L3 storage backend."""

    enabled: bool = False
    host_memory_gib: int = Field(default=64, ge=1, le=4096, description="Host KV cache per rank (--hicache-size).")
    storage_backend: Literal["mooncake"] | None = Field(default=None, description="--hicache-storage-backend.")
    mooncake_store: MooncakeStoreSpec | None = None

    def host_gib_per_rank(self) -> int:
        segment = self.mooncake_store.global_segment_gib if self.mooncake_store is not None else 0
        return self.host_memory_gib + segment if self.enabled else 0


def host_cache_rules(name: str) -> tuple[Rule, ...]:
    """The rules of a ``HostKvCacheSpec`` field called ``name`` (messages name the field)."""
    return (
        Rule(
            cel="!self.enabled || has(self.storageBackend)",
            message=f"{name}.enabled needs a storageBackend (mooncake)",
            check=lambda s: not s.enabled or s.storage_backend is not None,
            field_path=".storageBackend",
        ),
        Rule(
            cel="!has(self.storageBackend) || self.storageBackend != 'mooncake' || has(self.mooncakeStore)",
            message="storageBackend mooncake needs mooncakeStore",
            check=lambda s: s.storage_backend != "mooncake" or s.mooncake_store is not None,
            field_path=".mooncakeStore",
        ),
    )


class HiCacheSpec(HostKvCacheSpec):
    """Prefill-side hierarchical KV cache (HiCache) with an L3 storage backend."""

    cel_rules = host_cache_rules("hicache")


class SpeculativeSpec(CrdModel):
    """EAGLE3 speculative decoding, as SGLang's Kimi K2.6 cookbook runs it."""

    enabled: bool = False
    algorithm: Literal["EAGLE3"] = "EAGLE3"
    draft_model_path: str = Field(default="lightseekorg/kimi-k2.6-eagle3.1-mla", min_length=1, max_length=1024)
    num_steps: int = Field(default=3, ge=1, le=16, description="--speculative-num-steps.")
    eagle_topk: int = Field(default=1, ge=1, le=16, description="--speculative-eagle-topk.")
    num_draft_tokens: int = Field(default=4, ge=1, le=64, description="--speculative-num-draft-tokens.")


class JitCacheSpec(CrdModel):
    """Host directory kept across pod recreations for SGLang's compiled kernels."""

    host_path: str | None = Field(
        default="/var/cache/tandem/sglang",
        pattern=r"^/",
        max_length=1024,
        description="hostPath mounted as SGLANG_CACHE_DIR (null: the container's own, lost on recreate).",
    )


class WeightCacheSpec(CrdModel):
    """A node-local copy of the model (hostPath), filled before SGLang starts."""

    host_path: str = Field(pattern=r"^/", max_length=1024, description="Node directory, mounted at model.mountPath.")
    repo: str = Field(
        min_length=1, max_length=253, description="Hugging Face repo to prefetch, e.g. moonshotai/Kimi-K2.6."
    )
    prefetch: bool = Field(
        default=True,
        description="An init container downloads repo (at model.revision) into model.path (under mountPath) unless "
        "a completion marker of that repo and revision is there: an interrupted download is resumed, never loaded.",
    )
    node_label: QualifiedLabelKey | None = Field(
        default=None,
        description="A node label marking the nodes that hold the weight disk: worker pods then run only on such "
        "nodes (required node affinity), hostPath must exist there (type Directory: nothing is created on a root "
        "disk), and model.revision must pin a commit (every node stages the same snapshot). Unset: any node, "
        "hostPath created when missing (DirectoryOrCreate).",
    )
    stage_nodes: bool = Field(
        default=False,
        description="Stage the weights on every node labelled nodeLabel before a worker needs them: one Job per "
        "such node not yet labelled as holding them runs the prefetch there (pinned by nodeName, bounded by "
        "lifecycle.weightDownloadDeadlineSeconds, deleted an hour after it finished), and the node is labelled once "
        "it succeeds; status.weights reports the progress. A failed Job stays (failedNodes) until deleted, then it "
        "is created again. Needs nodeLabel and prefetch.",
    )

    cel_rules = (
        Rule(
            cel="!self.stageNodes || (has(self.nodeLabel) && self.prefetch)",
            message="weightCache.stageNodes stages the weights on the nodes labelled weightCache.nodeLabel with the "
            "prefetch: set nodeLabel and leave prefetch on",
            check=lambda s: not s.stage_nodes or (s.node_label is not None and s.prefetch),
            field_path=".stageNodes",
        ),
    )


class WeightsStatus(CrdModel):
    """Where the node-local copy of the model is staged (``model.weightCache.prefetch``)."""

    revision: str = Field(
        default="", max_length=253, description="The staged repo and revision, as the completion marker names it."
    )
    node_label: str = Field(
        default="",
        max_length=317,
        description="The label (value 'staged') the operator sets on a node once a worker's prefetch init container "
        "finished there: worker pods prefer such nodes (kubectl get nodes -l <nodeLabel>).",
    )
    staged_nodes: int = Field(default=0, ge=0, description="Nodes carrying nodeLabel.")
    nodes: int | None = Field(
        default=None, ge=0, description="With weightCache.stageNodes: the nodes labelled weightCache.nodeLabel."
    )
    staging_nodes: int | None = Field(
        default=None, ge=0, description="With weightCache.stageNodes: the nodes whose staging Job runs."
    )
    failed_nodes: int | None = Field(
        default=None,
        ge=0,
        description="With weightCache.stageNodes: the nodes whose staging Job failed (kubectl describe job; deleting "
        "it stages the node again).",
    )


class GangSchedulingSpec(CrdModel):
    """Place every pod of a group together or none (a partial group holds GPUs and serves nothing)."""

    scheduler_name: str | None = Field(default=None, max_length=253, description="Pod schedulerName, e.g. volcano.")
    pod_group: Literal["none", "volcano", "scheduler-plugins", "kueue"] = Field(
        default="none",
        description="volcano / scheduler-plugins: a PodGroup (minMember = nodesPerGroup) per group; kueue: the "
        "pod-group labels and annotation on each pod.",
    )


class PeerLoadingSpec(CrdModel):
    """Peer weight loading (issue #35): SGLang 0.5.23's remote-instance loader over Mooncake's transfer engine.

    Every pod is started with ``--remote-instance-weight-loader-start-seed-via-transfer-engine`` (a group that read
    its weights from the node publishes them). A group the operator creates whole (recreated after a death, added by
    a scale-out or a rollout) then loads with ``--load-format remote_instance`` from a seed the operator picks: a
    registered Ready group of the same role and template (same revision and layout) that loaded from the node
    itself (SGLang: a peer-loaded instance publishes nothing), not draining, quarantined or fenced, with fewer
    than ``maxLoadsPerSeed`` groups loading from it. With none, or when the group's previous incarnation died
    while loading from a peer (its seed died mid-load: SGLang fails the load and exits), it reads the node's copy.
    The choice of seed is per incarnation and rolls nothing. Each rank then runs a second Mooncake engine (its
    weights'), which takes its ports from the pod's window: ``ports.mooncakePorts`` must hold them."""

    enabled: bool = Field(
        default=False,
        description="Start every pod as a seed and load created groups from a peer when one is free (changing it "
        "rolls the pods: flags and Mooncake windows change).",
    )
    max_loads_per_seed: int = Field(
        default=2,
        ge=1,
        le=64,
        description="Groups that may load from one seed at once (they share its NICs); a further group loads from "
        "another seed or from the node's copy.",
    )
