"""SGLang's process model as data (``tandem_sim.model.ranks``): rank layout, the decode-to-prefill rank mapping, head
slices, the sharded KV pool and the flag checks. Pure: no processes."""

from __future__ import annotations

import re

import numpy as np
import pytest

from tandem_sim.config import ConfigError, MooncakeEnv, parse
from tandem_sim.engine.kvpool import ShardedPool
from tandem_sim.model.ranks import KVLayout, RankMapping, Topology, head_slice, heads_of_rank, rank_mapping
from tandem_sim.pd.prefill import RowSlice, transfer_segments


def test_kimi_layout_tp16_over_two_nodes_with_attention_dp() -> None:
    """``--tp 16 --nnodes 2 --attn-dp-size 8``: node 1 runs TP ranks 8..15 on its GPUs 0..7, two per DP group."""
    topo = Topology(tp_size=16, attn_dp_size=8, nnodes=2, node_rank=1)
    ranks = topo.local_ranks()
    assert [r.tp_rank for r in ranks] == list(range(8, 16))
    assert [r.gpu_id for r in ranks] == list(range(8))
    assert topo.attn_tp_size == 2
    assert [(r.attn_dp_rank, r.attn_tp_rank) for r in ranks[:4]] == [(4, 0), (4, 1), (5, 0), (5, 1)]


def test_tp8_prefill_to_tp8_decode_is_rank_to_rank() -> None:
    for mla in (True, False):
        for d in range(8):
            assert rank_mapping(8, 8, d, mla) == RankMapping(d, (d,), 1, 1)


def test_decode_tp_larger_than_prefill_tp_shares_one_sender() -> None:
    """prefill TP 2 -> decode TP 8: each prefill rank waits for 4 decode ranks' hand-overs, then writes to all."""
    for mla in (True, False):
        assert [rank_mapping(2, 8, d, mla).target_tp_ranks for d in range(8)] == [(0,)] * 4 + [(1,)] * 4
        assert rank_mapping(2, 8, 5, mla).required_dst_info_num == 4
        assert rank_mapping(2, 8, 5, mla).required_prefill_response_num == 1


def test_prefill_tp_larger_than_decode_tp_mha_pulls_from_each_mla_from_one() -> None:
    mha = rank_mapping(8, 2, 1, is_mla=False)
    assert mha == RankMapping(4, (4, 5, 6, 7), 1, 4)
    assert not any(mha.is_dummy(t, is_mla=False) for t in mha.target_tp_ranks)
    mla = rank_mapping(8, 2, 1, is_mla=True)
    assert mla == RankMapping(4, (4, 5, 6, 7), 1, 1)  # one real sender; the rest get dummy hand-overs
    assert [mla.is_dummy(t, is_mla=True) for t in mla.target_tp_ranks] == [False, True, True, True]


@pytest.mark.parametrize(
    ("prefill_tp", "decode_tp", "heads"), [(8, 8, 8), (8, 2, 8), (2, 8, 8), (4, 8, 2), (8, 4, 2), (1, 4, 4), (4, 1, 4)]
)
def test_head_slices_fill_every_decode_rank(prefill_tp: int, decode_tp: int, heads: int) -> None:
    """Over all senders mapped to a decode rank, the slices cover the heads that rank holds, each with the right head;
    only where prefill ranks replicate a head (prefill TP > heads) do several of them write it, as SGLang's do."""
    head_bytes = 8
    decode = KVLayout(heads * head_bytes, heads, decode_tp)
    for d in range(decode_tp):
        mapping = rank_mapping(prefill_tp, decode_tp, d, is_mla=False)
        written = np.zeros(decode.columns(d)[1], dtype=np.int64)
        for p in mapping.target_tp_ranks:
            s = head_slice(prefill_tp, decode_tp, p, d, heads)
            src_heads = heads_of_rank(prefill_tp, p, heads)
            global_head = src_heads.start + s.src_head_start
            assert global_head == heads_of_rank(decode_tp, d, heads).start + s.dst_head_start  # same heads
            written[s.dst_head_start * head_bytes : (s.dst_head_start + s.num_heads) * head_bytes] += 1
        replicas = max(1, prefill_tp // heads) if prefill_tp > decode_tp else 1
        assert written.tolist() == [min(replicas, len(mapping.target_tp_ranks))] * len(written)


@pytest.mark.parametrize(("heads", "attn_tp"), [(0, 1), (0, 4), (8, 4), (2, 4), (4, 2)])
def test_sharded_pool_reads_back_whole_rows(heads: int, attn_tp: int) -> None:
    layout = KVLayout(64, heads, attn_tp)
    pool = ShardedPool(8, 4, layout)
    pages = pool.alloc(10)
    assert pages is not None
    rows = np.random.default_rng(1).integers(0, 255, (10, 64), dtype=np.uint8)
    pool.write(pages, 0, rows)
    assert np.array_equal(pool.read(pages, 0, 10), rows)
    assert np.array_equal(pool.read(pages, 3, 1), rows[3:4])
    assert {s.kv_bytes for s in pool.shards} == {64 if heads == 0 else 64 // min(heads, attn_tp)}


def test_a_corrupt_mla_copy_on_any_rank_changes_what_is_read() -> None:
    pool = ShardedPool(4, 4, KVLayout(64, 0, 4))
    pages = pool.alloc(8)
    assert pages is not None
    rows = np.arange(8 * 64, dtype=np.uint8).reshape(8, 64)
    pool.write(pages, 0, rows)
    for rank in range(4):
        shard = pool.shards[rank]
        saved = shard.data.copy()
        shard.data[:] = 0
        assert not np.array_equal(pool.read(pages, 0, 8), rows), rank
        shard.data[:] = saved


def test_head_slice_moves_token_by_token() -> None:
    src, dst, lengths = transfer_segments(1000, [0], 4, 5000, [1], 4, 3, RowSlice(16, 32, 8, 16, 8))
    assert src == [1008, 1024, 1040]
    assert dst == [5000 + 4 * 32 + 16, 5000 + 5 * 32 + 16, 5000 + 6 * 32 + 16]
    assert lengths == [8, 8, 8]
    whole = transfer_segments(0, [0, 1], 2, 0, [2, 3], 2, 4, RowSlice(16, 16))
    assert whole == ([0], [64], [64])


def test_mooncake_env_as_sglang_and_mooncake_read_it() -> None:
    assert MooncakeEnv.from_env({"MC_FORCE_TCP": "true", "MOONCAKE_PROTOCOL": "rdma"}).protocol == "tcp"
    assert MooncakeEnv.from_env({}) == MooncakeEnv("rdma", (15000, 17000))
    # Mooncake ignores a range that touches the ephemeral ports (measured): the engines then use its default range.
    assert MooncakeEnv.from_env({"MC_MIN_RPC_PORT": "40000", "MC_MAX_RPC_PORT": "40007"}).ports == (15000, 17000)
    assert MooncakeEnv.from_env({"MC_MIN_RPC_PORT": "32760", "MC_MAX_RPC_PORT": "32770"}).ports == (15000, 17000)
    assert MooncakeEnv.from_env({"MC_MIN_RPC_PORT": "62000", "MC_MAX_RPC_PORT": "62007"}).ports == (62000, 62007)


@pytest.mark.parametrize(
    ("argv", "message"),
    [
        (["--tp-size", "3", "--nnodes", "2", "--dist-init-addr", "h:1"], "tp_size must be divisible by number of"),
        (["--tp-size", "4", "--dp-size", "2", "--attn-dp-size", "2"], "data-parallel replicas combined with attention"),
        (["--tp-size", "4", "--attn-dp-size", "3"], "assert cfg.tp_size % cfg.attn_dp_size == 0"),
        (["--tp-size", "2", "--dp-size", "2", "--nnodes", "2", "--dist-init-addr", "h:1"], "multi-node data-parallel"),
        (["--tp-size", "4", "--sim-kv-heads", "3"], "--sim-kv-heads 3 must divide"),
    ],
)
def test_layouts_sglang_refuses(argv: list[str], message: str) -> None:
    with pytest.raises(ConfigError, match=re.escape(message)):
        parse(["--model-path", "m", *argv], env={})


def test_deprecated_dp_attention_spelling_is_attention_dp() -> None:
    cfg = parse(["--model-path", "m", "--tp-size", "8", "--dp-size", "8", "--enable-dp-attention"], env={})
    assert (cfg.attn_dp_size, cfg.topology.attn_tp_size, len(cfg.topology.local_ranks())) == (8, 1, 8)
