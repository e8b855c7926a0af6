"""Calibration of the batch-variant numerics against the published experiment (``numerics.py``). Pure.

Thinking Machines Lab ("Defeating Nondeterminism in LLM Inference", Sep 2025) sampled one prompt 1,000 times at
temperature 0, 1,000 tokens each, on Qwen3-235B: 80 distinct answers, the most common 78 times, the first divergence
at token 103. ``calibrate`` repeats that through the real ``model.Decoder``: ``runs`` greedy completions of
``tokens`` tokens of one prompt (EOS ignored), every step of every run under a variant drawn at random (a decode
batch size from ``batch_sizes``, padded to its CUDA graph; for the first token a prefill batch of 1 to 8 prompts of
this length). Efficiently: runs that have not diverged share one decoder; a group is split only at a step whose
margin is below sigma (elsewhere no variant can flip), and a run alone in its group is already a distinct answer,
so it is not decoded further.
"""

from __future__ import annotations

import random
from collections.abc import Callable, Sequence
from dataclasses import dataclass

import numpy as np

from tandem_sim.model import model
from tandem_sim.model.numerics import (
    SIGMA,
    Numerics,
    PrefillVariant,
    Variant,
    decode_capture_sizes,
    default_decode_max_bs,
)

PREFILL_BATCH_PROMPTS = 8  # the first token's prefill batch holds 1..8 prompts of the same length


@dataclass(frozen=True)
class CalibrationResult:
    runs: int
    tokens: int
    distinct_answers: int
    most_common: int  # runs that gave the most common answer
    first_divergence: int | None  # 1-based position of the first token on which two runs differ (None: all equal)
    splits: int  # near-tie steps at which a group of runs split


@dataclass
class _Group:
    runs: int
    decoder: model.Decoder
    store: np.ndarray


def _reader(store: np.ndarray) -> Callable[[int, int], np.ndarray]:
    return lambda start, count: store[start : start + count]


def calibrate(
    prompt: str,
    runs: int = 1000,
    tokens: int = 1000,
    *,
    batch_sizes: Sequence[int] = range(1, 257),
    numerics: Numerics | None = None,
    seed: int = 0,
    weights_seed: int = 0,
    kv_bytes: int = 256,
) -> CalibrationResult:
    """``runs`` greedy completions of ``prompt`` under random variants (see the module docstring)."""
    if numerics is None:
        numerics = Numerics(capture=decode_capture_sizes(default_decode_max_bs(1, max(batch_sizes))))
    w = model.weights(weights_seed, kv_bytes)
    prompt_tokens = model.tokenize(prompt)
    n0 = len(prompt_tokens.ids)
    params = model.SamplingParams(max_new_tokens=tokens, temperature=0.0, ignore_eos=True)
    store = np.zeros((n0 + tokens, kv_bytes), dtype=np.uint8)
    store[:n0] = model.compute_kv(w, prompt_tokens)
    decoder = model.Decoder(w, n0, params, _reader(store), numerics)
    rng = random.Random(seed)
    # Decode variants: the padded classes of the batch sizes and how often each is drawn.
    weights: dict[Variant, int] = {}
    for bs in batch_sizes:
        variant = numerics.decode_variant(bs)
        weights[variant] = weights.get(variant, 0) + 1
    decode_variants, decode_weights = list(weights), list(weights.values())
    prefill_variants: list[Variant] = [PrefillVariant(n0 * j, 1, 0) for j in range(1, PREFILL_BATCH_PROMPTS + 1)]
    active = [_Group(runs, decoder, store)]
    alone = 0  # runs whose answer is already unlike every other run's
    first: int | None = None
    splits = 0
    for step in range(tokens):
        variants, var_weights = (prefill_variants, None) if step == 0 else (decode_variants, decode_weights)
        grown: list[_Group] = []
        for group in active:
            d = group.decoder
            flip: Variant | None = None
            keep: Variant | None = None
            if d.near_tie():
                drawn = rng.choices(range(len(variants)), weights=var_weights, k=group.runs)
                flipping = {i: d.flips(variants[i]) for i in set(drawn)}
                n_flip = sum(1 for i in drawn if flipping[i])
                flip = next((variants[i] for i, f in flipping.items() if f), None)
                keep = next((variants[i] for i, f in flipping.items() if not f), None)
                if 0 < n_flip < group.runs:
                    splits += 1
                    first = step + 1 if first is None else first
                    group.runs -= n_flip
                    if n_flip == 1:
                        alone += 1
                    else:
                        twin_store = group.store.copy()
                        twin = _Group(n_flip, d.fork(_reader(twin_store)), twin_store)
                        _step(twin, flip)
                        grown.append(twin)
                    if group.runs == 1:
                        alone += 1
                        continue
                elif n_flip == group.runs:
                    keep = flip
            _step(group, keep)
            grown.append(group)
        active = grown
    sizes = [g.runs for g in active]
    return CalibrationResult(
        runs=runs,
        tokens=tokens,
        distinct_answers=alone + len(active),
        most_common=max(sizes, default=1),
        first_divergence=first,
        splits=splits,
    )


def _step(group: _Group, variant: Variant | None) -> None:
    d = group.decoder
    d.next_token(variant)
    assert d.last_row is not None
    group.store[d.length - 1] = d.last_row[0]


def off_path(
    prompt: model.Tokens,
    output: model.Tokens,
    params: model.SamplingParams,
    *,
    weights_seed: int = 0,
    kv_bytes: int = 256,
) -> int | None:
    """The first output token (index) that no batch of a clean server could have produced, or None.

    An answer under batch-variant numerics is a valid greedy path when every token is the step's top-1 or, at a
    near-tie (margin below sigma), its runner-up, given the context of the prompt and the tokens before it. A
    repeated, missing or foreign token (a stream resumed at the wrong place, another request's KV) is off the path
    unless it happens to be exactly the near-tied runner-up. Each step is checked from a fresh decoder over the
    context (a prefill of prompt + the tokens so far leaves the state those decode steps left)."""
    w = model.weights(weights_seed, kv_bytes)
    context = model.Tokens(prompt.ids + output.ids, prompt.words + output.words)
    store = model.compute_kv(w, context)
    reader = _reader(store)
    for i, token in enumerate(output.ids):
        decoder = model.Decoder(w, len(prompt.ids) + i, params, reader, top_logprobs=2)
        chosen, _ = decoder.next_token()
        logprobs = decoder.logprobs
        if token == chosen:
            continue
        near_tie = logprobs is not None and logprobs.margin < SIGMA and logprobs.other.token == token
        if not near_tie:
            return i
    return None
