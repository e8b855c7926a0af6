"""SGLang 0.5.23's process model, as data: which GPU ranks a pod runs and how prefill ranks map to decode ranks.

Pure functions, no I/O. Sources (sglang 0.5.23 wheel):

* ranks of a node: ``_calculate_rank_ranges`` in ``sglang/srt/entrypoints/engine.py`` (node ``i`` of ``N`` runs TP
  ranks ``[i*T/N, (i+1)*T/N)``, one scheduler process each, GPU ``tp_rank % (T/N)``);
* attention layout: ``derive_attn_tp_size`` / ``derive_attention_ranks`` in ``sglang/srt/runtime_context.py``
  (``attn_tp_size = tp_size // attn_dp_size``, ``attn_tp_rank = tp_rank % attn_tp_size``, ``attn_dp_rank =
  tp_rank // attn_tp_size``);
* the decode-to-prefill rank mapping: ``CommonKVManager._resolve_rank_mapping`` in
  ``sglang/srt/disaggregation/common/conn.py``;
* which KV heads move between two ranks: ``compute_head_slice_params`` in
  ``sglang/srt/disaggregation/common/staging_buffer.py`` (used by ``MooncakeKVManager.send_kvcache_slice``).
"""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True)
class Rank:
    """One GPU rank (one SGLang scheduler process)."""

    tp_rank: int
    attn_tp_rank: int
    attn_dp_rank: int
    gpu_id: int


@dataclass(frozen=True)
class Topology:
    """The parallel layout of one SGLang server (all its nodes) and the node this process is."""

    tp_size: int
    attn_dp_size: int
    nnodes: int
    node_rank: int

    @property
    def attn_tp_size(self) -> int:
        return self.tp_size // self.attn_dp_size

    @property
    def ranks_per_node(self) -> int:
        return self.tp_size // self.nnodes

    def rank(self, tp_rank: int) -> Rank:
        return Rank(
            tp_rank,
            tp_rank % self.attn_tp_size,
            tp_rank // self.attn_tp_size,
            tp_rank % self.ranks_per_node,
        )

    def local_ranks(self) -> list[Rank]:
        """The ranks this node runs (``_calculate_rank_ranges``)."""
        per_node = self.ranks_per_node
        return [self.rank(r) for r in range(per_node * self.node_rank, per_node * (self.node_rank + 1))]


def check_parallel_flags(tp_size: int, nnodes: int, attn_dp_size: int, dp_size: int) -> str | None:
    """SGLang's message for a layout it refuses, or None (``check_server_args`` in ``arg_groups/validation_hook.py``,
    ``handle_data_parallelism`` in ``arg_groups/parallel_hook.py``)."""
    if attn_dp_size < 1:
        return f"--attn-dp-size must be positive (got {attn_dp_size})."
    if attn_dp_size > 1 and dp_size > 1:
        return (
            f"--dp-size {dp_size} with --attn-dp-size {attn_dp_size}: data-parallel replicas combined with attention "
            "data parallelism are not supported."
        )
    if tp_size < 1 or tp_size % nnodes != 0:
        return "tp_size must be divisible by number of nodes"
    if dp_size > 1 and nnodes != 1:
        return "multi-node data-parallel replicas are not supported; use attention DP (--attn-dp-size) across nodes"
    if tp_size % attn_dp_size != 0:
        return "assert cfg.tp_size % cfg.attn_dp_size == 0"
    return None


@dataclass(frozen=True)
class RankMapping:
    """What one decode rank pulls from a prefill (``PrefillServerInfo`` fields set by ``_resolve_rank_mapping``).

    ``target_tp_ranks``: the prefill attention-TP ranks this decode rank registers with and hands each room to;
    ``target_tp_rank``: for MLA the one of them that really sends (the others get dummy hand-overs);
    ``required_dst_info_num``: how many decode ranks' hand-overs a prefill rank waits for before it sends;
    ``required_prefill_response_num``: how many prefill ranks' success messages complete the room here.
    """

    target_tp_rank: int
    target_tp_ranks: tuple[int, ...]
    required_dst_info_num: int
    required_prefill_response_num: int

    def is_dummy(self, prefill_tp_rank: int, is_mla: bool) -> bool:
        """For MLA only ``target_tp_rank`` sends; for MHA every target sends (``_setup_bootstrap_infos``)."""
        return is_mla and prefill_tp_rank != self.target_tp_rank


def rank_mapping(prefill_attn_tp: int, decode_attn_tp: int, decode_engine_rank: int, is_mla: bool) -> RankMapping:
    """``CommonKVManager._resolve_rank_mapping`` (TP part; CP and PP are 1 here). ``decode_engine_rank`` is the
    decode's ``tp_rank % attn_tp_size`` (``kv_args.engine_rank`` in ``disaggregation/decode.py``)."""
    local = decode_engine_rank % decode_attn_tp
    if decode_attn_tp == prefill_attn_tp:
        return RankMapping(local, (local,), 1, 1)
    if decode_attn_tp > prefill_attn_tp:
        ratio = decode_attn_tp // prefill_attn_tp
        return RankMapping(local // ratio, (local // ratio,), ratio, 1)
    ratio = prefill_attn_tp // decode_attn_tp
    targets = tuple(range(local * ratio, (local + 1) * ratio))
    return RankMapping(targets[0], targets, 1, 1 if is_mla else ratio)


@dataclass(frozen=True)
class HeadSlice:
    """KV heads one prefill rank writes into one decode rank (``compute_head_slice_params``)."""

    src_head_start: int
    num_heads: int
    dst_head_start: int


def head_slice(src_attn_tp: int, dst_attn_tp: int, src_tp_rank: int, dst_tp_rank: int, total_heads: int) -> HeadSlice:
    src_per_rank = max(1, total_heads // src_attn_tp)
    dst_per_rank = max(1, total_heads // dst_attn_tp)
    if src_attn_tp > dst_attn_tp:
        replication = max(1, src_attn_tp // total_heads)
        unique = (src_tp_rank % src_attn_tp) // replication
        return HeadSlice(0, src_per_rank, (unique * src_per_rank) % dst_per_rank)
    replication = max(1, dst_attn_tp // total_heads)
    unique = (dst_tp_rank % dst_attn_tp) // replication
    return HeadSlice((unique * dst_per_rank) % src_per_rank, dst_per_rank, 0)


def heads_of_rank(attn_tp: int, attn_tp_rank: int, total_heads: int) -> range:
    """The KV heads an attention-TP rank holds (consecutive ranks share a head when ``attn_tp > total_heads``)."""
    per_rank = max(1, total_heads // attn_tp)
    first = (attn_tp_rank // max(1, attn_tp // total_heads)) * per_rank
    return range(first, first + per_rank)


@dataclass(frozen=True)
class KVLayout:
    """How one token's KV row (``kv_bytes``) is spread over the attention-TP ranks of a DP group.

    MLA (``total_heads == 0``; Kimi K2.x, DeepSeek): every rank holds the whole compressed latent row. MHA/GQA:
    the row is ``total_heads`` equal head slices and each rank holds ``heads_of_rank`` of them.
    """

    kv_bytes: int
    total_heads: int  # 0 = MLA
    attn_tp: int

    @property
    def is_mla(self) -> bool:
        return self.total_heads == 0

    @property
    def head_bytes(self) -> int:
        return self.kv_bytes if self.is_mla else self.kv_bytes // self.total_heads

    def columns(self, attn_tp_rank: int) -> tuple[int, int]:
        """(first byte, length) of the full row that ``attn_tp_rank`` holds."""
        if self.is_mla:
            return 0, self.kv_bytes
        heads = heads_of_rank(self.attn_tp, attn_tp_rank, self.total_heads)
        return heads.start * self.head_bytes, len(heads) * self.head_bytes

    def holders(self) -> list[tuple[int, int, list[int]]]:
        """(first byte, length, ranks holding it) for each distinct slice of the row; MLA: one slice, every rank."""
        slices: dict[tuple[int, int], list[int]] = {}
        for r in range(self.attn_tp):
            slices.setdefault(self.columns(r), []).append(r)
        return [(start, length, ranks) for (start, length), ranks in sorted(slices.items())]


def layout_error(kv_bytes: int, total_heads: int, attn_tp: int) -> str | None:
    """Why the simulated KV row cannot be split over ``attn_tp`` ranks, or None."""
    if total_heads == 0:
        return None
    if total_heads < 0 or kv_bytes % total_heads:
        return f"--sim-kv-heads {total_heads} must divide --sim-kv-bytes-per-token {kv_bytes}"
    if total_heads % attn_tp and attn_tp % total_heads:
        return f"--sim-kv-heads {total_heads} and the attention TP size {attn_tp} must divide one another"
    return None
