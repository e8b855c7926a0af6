"""Timing profiles of the simulated GPU (``--sim-profile``): the constants of the step-time model in
``engine/stepper.py``.

A profile's times are per attention-DP group (one SGLang scheduler, i.e. one GPU with ``--enable-dp-attention``,
or the whole TP group without it), the unit the simulator runs one batch loop for.

``kimi-k2.6-h200`` is derived from published SGLang PD + large-scale EP numbers for DeepSeek-V3-class MoE models
(MLA, 37B / 32B activated parameters; Kimi K2.x has DeepSeek-V3's architecture with 384 experts):

- LMSYS, "Deploying DeepSeek with PD Disaggregation and Large-scale Expert Parallelism on 96 H100 GPUs"
  (2025-05-05, https://lmsys.org/blog/2025-05-05-large-scale-ep/): **52.3k input tokens/s and 22.3k output
  tokens/s per node** (8 GPUs, DP attention, so 8 DP groups per node) for 2000-token inputs; the blog's stated
  limitations: **TTFT 2-5 s and ITL ~100 ms** at that throughput.
- The Mooncake team, "Deploying Kimi K2 with PD Disaggregation and Large-Scale Expert Parallelism on 128 H200
  GPUs" (LMSYS, 2025-07-20, https://lmsys.org/blog/2025-07-20-k2-large-scale-ep/): the same SGLang PD + EP recipe
  for Kimi K2 on H200; we take its setup (MLA, DP attention, EP over the decode nodes) and keep the DeepSeek
  per-node numbers above, which H200 (same Hopper compute as H100, more HBM) matches or beats.

Derivation (per DP group = per GPU):

- prefill: 52.3k tok/s / 8 = 6.54k tok/s, so ``prefill_ms_per_token`` = 1000 / 6537 = 0.153 ms. A 16384-token
  prefill batch (``--max-prefill-tokens`` default) then takes 2.5 s, inside the blog's 2-5 s TTFT.
- decode: 22.3k tok/s / 8 = 2.79k tok/s per GPU at ITL ~100 ms means a running batch of ~279 sequences of ~2050
  tokens of context per step. The step is ``base + per_seq * B + per_kv * sum(context)``; the split is ours
  (an assumption, not published): ``base`` = 20 ms (weights read and expert all-to-all of a nearly empty batch),
  the other 80 ms over 279 sequences = 0.287 ms per sequence of 2050 tokens, half of it attention over the KV:
  ``per_seq`` = 0.143 ms, ``per_kv_token`` = 0.143 / 2050 = 7.0e-5 ms. Check: B = 279, 2050 tokens each:
  20 + 39.9 + 40.0 = 99.9 ms per step, 2.79k tok/s.

``time_factor`` multiplies every simulated time (a run at factor 4 is 4x slower, so Python's own work per token
stays small next to the simulated GPU time on a 2-core machine); the bench divides measured times by it.

Start-up (``LoadProfile``, the phases of ``weights.py``; times are multiplied by ``time_factor`` too). For
``kimi-k2.6-h200``, per 8xH200 node; **published** figures are marked, the rest are **our estimates**:

- ``weight_bytes`` 600 GB: Kimi K2.6 INT4, the figure of issue #35 (Cloudflare cites ~560 GB for Kimi K2.5 on 8xH100,
  "Building the foundation for running extra-large language models", 2026-04-16).
- ``download_gb_s`` 1.25 GB/s (10 Gbit/s sustained from the hub or an object store): estimate.
- ``read_gb_s`` 12 GB/s from the node's copy: derived from a **published log**, DeepSeek-V3 on 8xH200 with SGLang
  reading its 163 safetensors shards (~690 GB) at ~3.2 shards/s, ~51 s (sgl-project/sglang#3416, #7181); the
  files were likely in the page cache, so an NVMe-cold read is slower.
- ``peer_gb_s`` 190 GB/s: **published**, Mooncake Transfer Engine over 8x400 Gbps RoCE (Mooncake's
  transfer-engine benchmark, 40 GB payloads; TCP reaches ~41 GB/s there).
- ``register_s`` 2 s: transfer-engine memory registration, "this may take a few seconds" (SGLang's log line in
  ``RemoteInstanceModelLoader.load_model``): estimate.
- ``init_s`` 15 s (process start, NCCL, model construction), ``jit_s`` 20 s (kernel warm-up with warm JIT caches;
  cold DeepGEMM compiles take minutes): estimates.
- ``cuda_graph_s`` 12 s: a **published log** of SGLang's decode graph capture on Hopper, "Capture cuda graph end.
  Time elapsed: 12.11 s" (sgl-project/sglang#10088; that model is not K2.6).
- ``server_warmup_s`` 1.5 s: ``_execute_server_warmup`` sleeps 1 s before its first ``/model_info`` (source), then
  one short request (estimate).

``cpu-small`` and ``instant`` load nothing (``NO_LOAD``): the tests' workers start as fast as before. The phases
only take time with ``--sim-load-phases`` (``config.py`` puts ``NO_LOAD`` in the profile otherwise), so the
benches and operator tests that run ``kimi-k2.6-h200`` for its step times keep their start-up.

``overhead`` multiplies every step time too: ``--enable-deterministic-inference`` sets it to 1.3435, SGLang's
published cost of its batch-invariant kernels ("With CUDA graphs enabled ... reducing performance overhead to
34.35%", LMSYS, "Towards Deterministic Inference in SGLang and Reproducible RL Training", 2025-09-22;
``numerics.DETERMINISTIC_OVERHEAD``).
"""

from __future__ import annotations

from dataclasses import dataclass, replace


@dataclass(frozen=True)
class LoadProfile:
    """Start-up sizes and bandwidths of one node (``weights.phases``); bandwidths in GB/s (1e9 bytes)."""

    weight_bytes: float  # the whole checkpoint
    download_gb_s: float  # hub or object store -> node (--load-format auto, no local copy)
    read_gb_s: float  # node copy -> GPUs (every rank reads the whole checkpoint, from the page cache after the first)
    peer_gb_s: float  # seed node -> this node over the Mooncake fabric (--load-format remote_instance)
    register_s: float  # transfer-engine memory registration of the weights (peer and seed)
    init_s: float  # process start, distributed set-up, model construction
    jit_s: float  # kernel JIT and warm-up
    cuda_graph_s: float  # decode CUDA-graph capture
    server_warmup_s: float  # HTTP up, status Starting, until the warm-up request passed


NO_LOAD = LoadProfile(0.0, 1.0, 1.0, 1.0, 0.0, 0.0, 0.0, 0.0, 0.0)
KIMI_LOAD = LoadProfile(
    weight_bytes=600e9,
    download_gb_s=1.25,
    read_gb_s=12.0,
    peer_gb_s=190.0,
    register_s=2.0,
    init_s=15.0,
    jit_s=20.0,
    cuda_graph_s=12.0,
    server_warmup_s=1.5,
)


@dataclass(frozen=True)
class SimProfile:
    name: str
    prefill_base_ms: float  # per prefill batch (kernel launches, one forward)
    prefill_ms_per_token: float  # per prompt token computed (cached tokens are skipped)
    decode_base_ms: float  # per decode step, whatever the batch
    decode_ms_per_seq: float  # per running sequence in the step
    decode_ms_per_kv_token: float  # per KV token attended in the step (sum of the sequences' lengths)
    time_factor: float = 1.0
    overhead: float = 1.0  # step-time factor of the kernels: 1.3435 with --enable-deterministic-inference
    load: LoadProfile = NO_LOAD  # start-up phases

    def wall_s(self, simulated_s: float) -> float:
        """Seconds of wall time for ``simulated_s`` seconds of start-up (the time factor, not the kernels')."""
        return simulated_s * self.time_factor

    def scaled(self, ms: float) -> float:
        """Seconds of wall time for ``ms`` of simulated GPU time."""
        return ms * self.overhead * self.time_factor / 1000.0

    def prefill_s(self, tokens: int) -> float:
        return self.scaled(self.prefill_base_ms + self.prefill_ms_per_token * tokens) if tokens else 0.0

    def decode_s(self, seqs: int, kv_tokens: int) -> float:
        return self.scaled(
            self.decode_base_ms + self.decode_ms_per_seq * seqs + self.decode_ms_per_kv_token * kv_tokens
        )

    def with_overrides(self, **changes: float | None) -> SimProfile:
        kept: dict[str, float] = {k: float(v) for k, v in changes.items() if v is not None}
        return replace(self, **kept)  # type: ignore[arg-type]  # only float fields are ever passed


@dataclass(frozen=True)
class Published:
    """The published numbers a profile was built from, per DP group (GPU), for the bench's comparison column."""

    prefill_tok_s: float
    decode_tok_s: float
    itl_ms: float
    ttft_s: tuple[float, float]


KIMI_PUBLISHED = Published(prefill_tok_s=52_300 / 8, decode_tok_s=22_300 / 8, itl_ms=100.0, ttft_s=(2.0, 5.0))

PROFILES = {
    "instant": SimProfile("instant", 0.0, 0.0, 0.0, 0.0, 0.0),
    # Today's defaults (0.02 ms per prompt token, 2 ms per decoded token) for one sequence; a small per-sequence
    # cost so that latency grows with the batch.
    "cpu-small": SimProfile("cpu-small", 0.0, 0.02, 2.0, 0.01, 0.0),
    "kimi-k2.6-h200": SimProfile("kimi-k2.6-h200", 0.0, 1000 / 6537, 20.0, 0.143, 7.0e-5, load=KIMI_LOAD),
}
DEFAULT_PROFILE = "cpu-small"
