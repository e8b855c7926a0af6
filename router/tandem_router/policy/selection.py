"""Worker selection policies. Each takes a snapshot of the candidates and returns the chosen one's index.

Candidates are already filtered (healthy, breaker closed, not tried before by this request); every function
here only ranks them. Randomness comes in as a ``random.Random`` so tests are deterministic.
"""

from __future__ import annotations

import random
from collections.abc import Sequence
from dataclasses import dataclass
from enum import StrEnum


class Policy(StrEnum):
    ROUND_ROBIN = "round_robin"
    POWER_OF_TWO = "power_of_two"
    CACHE_AWARE = "cache_aware"  # prefill by approximate prefix cache and token load (cache_aware.py), decode by load
    RANDOM = "random"


@dataclass(frozen=True)
class Candidate:
    """What a policy may know about one worker."""

    key: str
    in_flight: int = 0
    kv_usage: float = 0.0  # fraction of the KV pool in use, 0..1, scraped from the worker's /metrics
    queued: int = 0  # requests waiting in the worker's queue, scraped


def round_robin(count: int, counter: int) -> int:
    """The ``counter``-th of ``count`` candidates, wrapping (no load is looked at, so no ``Candidate`` is built).
    The caller increments its counter per decision."""
    return counter % count


def power_of_two(candidates: Sequence[Candidate], rng: random.Random) -> int:
    """Two distinct random candidates; the one with fewer requests in flight (ties: the first drawn)."""
    if len(candidates) == 1:
        return 0
    a, b = rng.sample(range(len(candidates)), 2)
    return b if candidates[b].in_flight < candidates[a].in_flight else a


def load_aware_decode(candidates: Sequence[Candidate], *, kv_weight: float = 16.0) -> int:
    """Decode choice by load: requests in flight and queued, plus KV pool usage weighted as ``kv_weight`` requests.

    A decode near a full KV pool must retract or queue new requests, so usage counts even when few are running.
    """
    return min(
        range(len(candidates)),
        key=lambda i: candidates[i].in_flight + candidates[i].queued + kv_weight * candidates[i].kv_usage,
    )


def least_loaded_rank(in_flight: Sequence[int]) -> int:
    """The decode attention-DP rank with the fewest of this router's requests in flight (ties: the lowest rank).

    SGLang 0.5.23 sends a request with ``routed_dp_rank`` (``io_struct.GenerateReqInput``; ``data_parallel_rank``
    is its deprecated alias) to that DP rank (``DataParallelController.maybe_external_dp_rank_routing``); without
    it a decode spreads requests over its ranks round robin (``handle_load_balance_method``), blind to which ranks
    hold long generations."""
    return min(range(len(in_flight)), key=lambda r: (in_flight[r], r))
