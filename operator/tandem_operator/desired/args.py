"""The SGLang 0.5.23 command line of one pod (``python3 -m sglang.launch_server ...``). Pure.

Flag spellings follow SGLang 0.5.23 (``--attn-dp-size`` is the new spelling of ``--dp-size N
--enable-dp-attention``); ``tests/operator/test_sglang_args.py`` checks the output against the flag table read from
the pinned SGLang wheel, and ``tests/conformance/test_sglang_parser.py`` with SGLang's own ``prepare_server_args``.
"""

from __future__ import annotations

from dataclasses import dataclass

from tandem.registry import Role
from tandem_operator.api.pdcluster import DecodeSpec, PDClusterSpec, PrefillSpec, TransferProtocol
from tandem_operator.desired.seeding import SEED_FLAG, Seed, peer_flags

LAUNCH = ("python3", "-m", "sglang.launch_server")


@dataclass(frozen=True)
class Placement:
    """Where one pod sits in its group."""

    role: Role
    node_rank: int
    leader_address: str  # the group leader's stable DNS name (headless Service)
    epoch: int = 0  # the group's incarnation: a prefill's bootstrap port moves with it
    seed: Seed | None = None  # the serving group this incarnation pulls its weights from (spec.peerLoading)


def sglang_args(spec: PDClusterSpec, placement: Placement) -> list[str]:
    """Arguments after ``sglang.launch_server``. ``$(POD_IP)`` is expanded by the kubelet from the pod's env."""
    role = spec.role(placement.role)
    model = spec.model
    args = ["--model-path", model.path, "--served-model-name", model.served_name]
    if model.revision is not None:
        args += ["--revision", model.revision]
    if model.trust_remote_code:
        args.append("--trust-remote-code")
    if model.tool_call_parser is not None:
        args += ["--tool-call-parser", model.tool_call_parser]
    if model.reasoning_parser is not None:
        args += ["--reasoning-parser", model.reasoning_parser]
    if model.context_length is not None:
        args += ["--context-length", str(model.context_length)]
    args += ["--host", "$(POD_IP)", "--port", str(role.ports.http), "--enable-metrics"]

    args += ["--tp-size", str(role.tp_size), "--ep-size", str(role.ep_size)]
    if role.attn_dp_size > 1:
        args += ["--attn-dp-size", str(role.attn_dp_size)]
    if role.moe_a2a_backend == "deepep":
        args += ["--moe-a2a-backend", "deepep", "--deepep-mode", role.deepep_mode.value]
    if role.enable_eplb:
        args.append("--enable-eplb")
    if role.ep_num_redundant_experts:
        args += ["--ep-num-redundant-experts", str(role.ep_num_redundant_experts)]
    if role.moe_dense_tp_size is not None:
        args += ["--moe-dense-tp-size", str(role.moe_dense_tp_size)]
    if role.enable_dp_lm_head:
        args.append("--enable-dp-lm-head")
    if role.enable_two_batch_overlap:
        args.append("--enable-two-batch-overlap")
    if role.chunked_prefill_size is not None:  # per attention-DP rank; SGLang divides the flag by attn_dp_size
        args += ["--chunked-prefill-size", str(role.chunked_prefill_size * role.attn_dp_size)]
    if role.mem_fraction_static is not None:
        args += ["--mem-fraction-static", repr(role.mem_fraction_static)]
    if isinstance(role, DecodeSpec) and role.max_running_requests is not None:
        # one attention-DP rank's batch gets CUDA graphs up to its share, no more, no less
        per_rank = role.max_running_requests // role.attn_dp_size
        args += ["--max-running-requests", str(role.max_running_requests), "--cuda-graph-max-bs-decode", str(per_rank)]
    if spec.deterministic_inference:  # both roles: the first token comes out of the prefill, the rest the decode
        args.append("--enable-deterministic-inference")
    page_size = spec.effective_page_size()
    if page_size is not None:  # the same for both roles: KV pages move from prefill to decode as they are
        args += ["--page-size", str(page_size)]

    if role.nodes_per_group > 1:
        args += [
            "--dist-init-addr",
            f"{placement.leader_address}:{role.ports.dist_init}",
            "--nnodes",
            str(role.nodes_per_group),
            "--node-rank",
            str(placement.node_rank),
        ]
    elif spec.peer_loading.enabled:
        # A seed's ranks publish their weights to the engine-info bootstrap server, which listens on --host (the pod
        # IP), at 127.0.0.1 on one node unless --dist-init-addr names the head (SGLang 0.5.23
        # remote_instance_weight_transporter.py: _register_to_engine_info_bootstrap): with the group's own address
        # the PUT reaches it, else a one-node seed publishes nothing and every pull from it fails.
        args += ["--dist-init-addr", f"{placement.leader_address}:{role.ports.dist_init}"]

    args += ["--disaggregation-mode", placement.role.value, "--disaggregation-transfer-backend", "mooncake"]
    if spec.transfer.protocol is TransferProtocol.RDMA and spec.transfer.ib_devices:
        # none named: the worker image's entrypoint adds the devices with an ACTIVE port (images/README.md)
        args += ["--disaggregation-ib-device", ",".join(spec.transfer.ib_devices)]
    if placement.role is Role.PREFILL:
        args += ["--disaggregation-bootstrap-port", str(role.ports.bootstrap_at(placement.epoch))]
    speculative = model.speculative
    if speculative.enabled:  # SGLang's Kimi K2.6 cookbook: EAGLE3 with its draft model
        args += ["--speculative-algorithm", speculative.algorithm]
        args += ["--speculative-draft-model-path", speculative.draft_model_path]
        args += ["--speculative-num-steps", str(speculative.num_steps)]
        args += ["--speculative-eagle-topk", str(speculative.eagle_topk)]
        args += ["--speculative-num-draft-tokens", str(speculative.num_draft_tokens)]
    if isinstance(role, PrefillSpec) and role.hicache.enabled and role.hicache.storage_backend is not None:
        args += ["--enable-hierarchical-cache", "--hicache-size", str(role.hicache.host_memory_gib)]
        args += ["--hicache-storage-backend", role.hicache.storage_backend]
    if isinstance(role, DecodeSpec) and role.kv_offload.enabled and role.kv_offload.storage_backend is not None:
        args += [
            "--disaggregation-decode-enable-offload-kvcache",
            "--hicache-size",
            str(role.kv_offload.host_memory_gib),
            "--hicache-storage-backend",
            role.kv_offload.storage_backend,
        ]
    if spec.peer_loading.enabled:  # every server publishes the weights it read itself (desired/seeding.py)
        args.append(SEED_FLAG)
        if placement.seed is not None:
            args += peer_flags(placement.seed)
    return args + list(role.extra_args)


def launch_command(spec: PDClusterSpec, placement: Placement) -> list[str]:
    return [*LAUNCH, *sglang_args(spec, placement)]
