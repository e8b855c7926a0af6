"""Batch-variant GPU numerics: why a temperature-0 answer depends on the batch around the request. Pure.

What is modelled (issue #33). A GPU serving LLMs without batch-invariant kernels is not batch-invariant: the
reduction order of a matmul, of attention's split-KV and of the all-reduce depends on the shapes the kernels see, so
a request's logits differ in their last bits with the batch it runs in. Greedy decoding usually does not care, but
at a step whose top-two candidates are nearly tied the argmax flips, and the continuation diverges from there:

- Thinking Machines Lab, "Defeating Nondeterminism in LLM Inference" (He et al., Sep 2025): 1,000 temperature-0
  completions of 1,000 tokens of one prompt on Qwen3-235B gave **80 distinct answers**, the most common **78 times**,
  all identical for the first **102 tokens** (first divergence at token 103).
- SGLang's ``--enable-deterministic-inference`` (batch-invariant kernels) makes the output invariant, at a cost:
  "With CUDA graphs enabled ... reducing performance overhead to **34.35%**" (LMSYS, "Towards Deterministic
  Inference in SGLang and Reproducible RL Training", 2025-09-22). ``DETERMINISTIC_OVERHEAD`` multiplies the
  profile's step times by that.

The model, per greedy step (``model.Decoder.next_token``):

- a **logit margin** between the top-1 token and a runner-up, a deterministic function of the decoder state (a
  digest of the context), so it is the same on every server: ``margin(state)``;
- a **perturbation** uniform in ``[-SIGMA, SIGMA)``, a deterministic function of (state, variant):
  ``Numerics.perturbation``. The variant is what the kernels saw: for a decode step the decode batch size padded to
  SGLang's CUDA-graph capture size (sizes that pad to the same graph replay the same kernels, so they share
  numerics, as on a GPU), for the first token (computed by the prefill) the prefill batch's composition (its
  tokens, the chunks the prompt took, the radix-cached tokens). With deterministic inference the perturbation is 0;
- the step takes the runner-up when ``margin + perturbation < 0``; a flipped token rolls into the state, so the
  rest of the answer diverges, as on a GPU.

Scale. ``SIGMA`` = 0.125 nats is one bf16 ulp at ``|logit|`` in [16, 32) (bf16 keeps 8 significant bits:
2^4 * 2^-7), where the top logits of large models sit: a different reduction order changes a logit by about its
last bit. Margins are exponential with ``P(margin < SIGMA) = NEAR_TIE_P`` = 1/100 (only their density near 0
matters: 0.08 per nat); a near-tie flips for a random variant with probability 1/4 on average, so among 1,000 runs
the first divergence falls near the first near-tie step, token ~100, as published (measured by ``calibration``,
numbers in simulator/README.md). The real size of perturbations depends on the model, the hardware, the kernels
and the parallelism; nothing here was calibrated on a GPU.

SGLang 0.5.23 source read for this (pinned wheel):

- ``srt/arg_groups/attention_hook.py``: ``handle_deterministic_inference`` (deterministic sampling and attention
  backends, NCCL tree all-reduce with pinned channels, custom/symmetric-memory all-reduce off when TP > 1);
- ``srt/arg_groups/cuda_graph_hook.py``: ``generate_decode_cuda_graph_batch_sizes`` (the capture list, reproduced
  by ``decode_capture_sizes``); ``srt/arg_groups/memory_hook.py`` (``_handle_gpu_memory_settings``: decode
  ``max_bs`` 256 for TP < 4 and 512 otherwise on H100/H200-class memory, capped at ``--max-running-requests``);
- ``srt/model_executor/runner/decode_cuda_graph_runner.py``: ``can_run_graph`` (a batch above ``max_bs`` runs
  eagerly, unpadded), ``replay_prepare`` -> ``base_cuda_graph_runner._pad_to_bucket`` (bisect to the smallest
  capture size >= the batch): ``padded_batch_size``;
- ``srt/disaggregation/prefill.py``: ``process_batch_result_disagg_prefill`` and ``srt/disaggregation/utils.py``:
  ``MetadataBuffers.set_buf`` (in PD mode the prefill computes the first token and sends it with the KV, so step 0
  runs under the prefill server's batch).

Not modelled: the attention-DP case where the padding follows the largest DP rank's batch
(``require_mlp_tp_gather``); flips of EOS; perturbations of sampling at temperature > 0 beyond the seed.
"""

from __future__ import annotations

import bisect
import hashlib
import math
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

SIGMA = 0.125  # nats: one bf16 ulp at |logit| in [16, 32)
NEAR_TIE_P = 0.01  # P(margin < SIGMA): a near-tie every ~100 tokens
DETERMINISTIC_OVERHEAD = 1.3435  # --enable-deterministic-inference step-time factor (LMSYS, 2025-09-22: 34.35%)
MARGIN_SCALE = SIGMA / -math.log1p(-NEAR_TIE_P)  # exponential margins: P(m < SIGMA) = NEAR_TIE_P (mean 12.4 nats)
_U32 = float(1 << 32)
_U64 = float(1 << 64)
# margin(u) = -MARGIN_SCALE * log(1 - u / 2^32) < SIGMA  <=>  u < NEAR_TIE_U32: the hot path compares integers only.
NEAR_TIE_U32 = math.ceil(-math.expm1(-SIGMA / MARGIN_SCALE) * _U32)
TAIL_STEP = 1.0  # nats between consecutive candidates below the top two (reported top_logprobs beyond 2)


@dataclass(frozen=True, slots=True)
class DecodeVariant:
    """A decode step's kernels: the batch size its CUDA graph was captured for (the padded batch size)."""

    batch_size: int

    def key(self) -> bytes:
        return b"d%d" % self.batch_size


@dataclass(frozen=True, slots=True)
class PrefillVariant:
    """The prefill batch that produced a prompt's first token: its tokens (the batch in which the prompt's last
    chunk ran), the chunks the prompt took, and the prompt's radix-cached tokens."""

    batch_tokens: int
    chunks: int
    cached_tokens: int

    def key(self) -> bytes:
        return b"p%d:%d:%d" % (self.batch_tokens, self.chunks, self.cached_tokens)

    def to_json(self) -> dict[str, int]:
        return {"batch_tokens": self.batch_tokens, "chunks": self.chunks, "cached_tokens": self.cached_tokens}

    @classmethod
    def from_json(cls, doc: Any) -> PrefillVariant | None:
        """The variant a prefill sent along with its success outcome (None when absent or malformed)."""
        if not isinstance(doc, dict):
            return None
        try:
            return cls(int(doc["batch_tokens"]), int(doc["chunks"]), int(doc["cached_tokens"]))
        except (KeyError, TypeError, ValueError):
            return None


Variant = DecodeVariant | PrefillVariant


def decode_capture_sizes(max_bs: int, speculative: bool = False) -> tuple[int, ...]:
    """SGLang's decode CUDA-graph capture sizes for ``max_bs`` (``generate_decode_cuda_graph_batch_sizes``)."""
    if speculative:
        sizes = [*range(1, 9), *range(10, 33, 2), *range(40, 65, 4), *range(72, 257, 8), *range(272, max_bs + 1, 16)]
    else:
        sizes = [1, 2, 4, 8, 12, *range(16, 257, 8), *range(272, 512, 16), *range(512, max_bs + 1, 32)]
    sizes = [bs for bs in sizes if bs <= max_bs]
    if max_bs not in sizes:
        sizes.append(max_bs)
    return tuple(sizes)


def default_decode_max_bs(tp_size: int, max_running_requests: int | None) -> int:
    """``max_bs`` of the decode graphs on an H100/H200-class GPU (``_handle_gpu_memory_settings``): 256 below TP 4,
    else 512, capped at ``--max-running-requests``."""
    max_bs = 256 if tp_size < 4 else 512
    if max_running_requests is not None and max_bs > max_running_requests:
        max_bs = max_running_requests
    return max_bs


def padded_batch_size(raw_bs: int, capture: Sequence[int]) -> int:
    """The graph a decode batch of ``raw_bs`` replays (``_pad_to_bucket``): the smallest capture size >= it; a batch
    above the largest (or with no graphs) runs eagerly at its own size."""
    if not capture or raw_bs > capture[-1]:
        return raw_bs
    return capture[bisect.bisect_left(capture, raw_bs)]


def margin_u32(state: bytes) -> int:
    """The margin's 32-bit draw (``margin`` is monotonic in it; ``< NEAR_TIE_U32`` means a near-tie)."""
    return int.from_bytes(state[0:4], "little")


def margin(state: bytes) -> float:
    """The logit gap (nats) between the top-1 token and the runner-up at the step whose decoder state is ``state``."""
    return -MARGIN_SCALE * math.log1p(-margin_u32(state) / _U32)


def tail_ratio(state: bytes) -> float:
    """Probability mass of every token below the top two, relative to the lower of the two: in [0.6, 4)."""
    return 0.6 + 3.4 * state[12] / 256.0


class Numerics:
    """The numerics of one server: batch-variant (SGLang's default) or batch-invariant (deterministic inference).

    ``capture`` is the decode CUDA-graph capture list (empty: no graphs, no padding)."""

    def __init__(self, deterministic: bool = False, capture: Sequence[int] = (), sigma: float = SIGMA) -> None:
        self.deterministic = deterministic
        self.capture = tuple(capture)
        self.sigma = sigma
        self._decode: dict[int, DecodeVariant] = {}

    def decode_variant(self, raw_bs: int) -> DecodeVariant:
        """The variant of a decode step of ``raw_bs`` running sequences (padded to its CUDA graph)."""
        variant = self._decode.get(raw_bs)
        if variant is None:
            variant = self._decode[raw_bs] = DecodeVariant(padded_batch_size(raw_bs, self.capture))
        return variant

    def perturbation(self, state: bytes, variant: Variant | None) -> float:
        """The logit-gap error (nats) the kernels of ``variant`` add at the step of ``state``; 0 when deterministic
        or without a variant (no batch: a standalone computation)."""
        if self.deterministic or variant is None:
            return 0.0
        digest = hashlib.blake2b(state + variant.key(), digest_size=8, key=b"numerics").digest()
        return self.sigma * (2.0 * int.from_bytes(digest, "little") / _U64 - 1.0)

    def near_tie(self, state: bytes) -> bool:
        """Some variant could flip this step (always False when deterministic)."""
        return not self.deterministic and margin_u32(state) < NEAR_TIE_U32


DETERMINISTIC = Numerics(deterministic=True)


@dataclass(frozen=True, slots=True)
class Candidate:
    """One entry of a step's top logprobs: token id, its word and its logprob."""

    token: int
    word: str
    logprob: float


@dataclass(frozen=True, slots=True)
class StepLogprobs:
    """A step's logprobs as observed (after the perturbation). ``chosen`` is the emitted token, always the one with
    the higher logprob; ``other`` the second of the step's top two (the runner-up, or after a flip the top-1)."""

    chosen: Candidate
    other: Candidate
    margin: float  # the unperturbed top-1 / runner-up gap (nats): the same on every server
    perturbation: float  # what this step's kernels added to it
    tail: tuple[Candidate, ...] = ()  # candidates 3.. (only when more than two were asked for)

    def top(self, k: int) -> tuple[Candidate, ...]:
        """The step's top ``k`` candidates, descending."""
        return (self.chosen, self.other, *self.tail)[: max(k, 0)]


def top_two_logprobs(observed_margin: float, tail: float) -> tuple[float, float, float]:
    """(logprob of the top-1 token, logprob of the runner-up, logprob of the third candidate) for a runner-up
    ``observed_margin`` nats below the top-1 (negative: above it) and ``tail`` (``tail_ratio``) times the lower one's
    probability spread over every other token. Candidates 3, 4, ... sit ``TAIL_STEP`` nats apart below the lower
    of the two, which keeps their sum (0.58 times the lower one's probability) inside the tail."""
    low = -max(observed_margin, 0.0)
    log_z = math.log(1.0 + math.exp(-observed_margin) + tail * math.exp(low))
    return -log_z, -observed_margin - log_z, low - TAIL_STEP - log_z
