"""Cache-aware prefill choice, as a pure function.

The prefill choice follows SGLang's gateway ``smg`` 1.13 (lightseekorg/smg
``model_gateway/src/policies/cache_aware.rs``, ``CacheAwarePolicy::select_worker`` /
``select_worker_with_text`` / ``is_imbalanced``), with its three knobs:

- ``cache_threshold`` (smg default 0.5): the best match must cover more than this share of the key, else the
  request is treated as a cache miss;
- ``balance_abs_threshold`` and ``balance_rel_threshold`` (smg: 32 requests and 1.1): when the load spread is
  larger than both (``max - min > abs`` and ``max > rel * min``) cache affinity is abandoned for the least loaded.

What Tandem changes, and why:

- Load is prefill work in tokens, not requests: the prompt tokens in flight on a prefill that it must compute
  (each request's tokens minus what its tree matched when it was sent). A prefill's time to first token grows
  with the tokens ahead of it; a count of requests treats a 30-token turn and a 30k-token document alike. The
  balance thresholds are therefore in tokens (``balance_abs_threshold`` default 4096, about 0.6 s of a
  Kimi-K2.6 H200 prefill's work in the simulator's ``kimi-k2.6-h200`` profile, chosen by ``tandem bench prefix``:
  1024 spread the work more evenly but gave up more cache hits; ``rel`` stays smg's 1.1).
- Cost, not just the longest match: each prefill's cost is its load plus the part of this prompt it does not
  cache, ``load + (tokens - matched)``: the prefill that would finish this prompt first. The longest match wins
  while the pool is balanced and its cost is within ``balance_abs_threshold`` of the cheapest (smg's abs AND rel
  test applied to the costs of the preferred and the cheapest prefill, not to the whole pool's spread: one busy
  prefill elsewhere does not turn affinity off for everyone). On a miss the cheapest wins (smg: the least loaded,
  which with equal misses is the same), so a shared system prompt that every prefill already holds does not pin
  new conversations to one of them.
- Ties go to the prefill whose tree is smallest (the most cache room: smg's choice on a miss in its
  description; its code takes the least loaded), then the lowest index, so sequential new conversations spread
  over the prefills' caches instead of all filling the first.

Token estimates: a key of token ids counts its ids; a text key counts ``ceil(chars / CHARS_PER_TOKEN)``
(byte-level BPE tokenizers average about 4 characters per token on English). Only their ratios across prefills
matter.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass

from tandem_router.policy.prefix_tree import RoutingKey

CHARS_PER_TOKEN = 4


@dataclass(frozen=True)
class CacheAwareConfig:
    cache_threshold: float = 0.5  # smg's default
    balance_abs_threshold: int = 4096  # tokens of prefill work (smg: 32 requests)
    balance_rel_threshold: float = 1.1  # smg's default
    max_tree_units: int = 1 << 20  # per prefill: token ids or characters remembered (smg: 10000 per worker)


@dataclass(frozen=True)
class PrefillView:
    """What the prefill choice knows about one candidate: how much of this key it matched, its work in flight."""

    matched: int  # units of the key its tree matched
    load_tokens: int  # uncached prompt tokens in flight on it
    tree_units: int = 0  # size of its tree: the ties' tie-break


def key_tokens(key: RoutingKey) -> int:
    """Estimated prompt tokens of a routing key."""
    return len(key) if isinstance(key, tuple) else math.ceil(len(key) / CHARS_PER_TOKEN)


def uncached_tokens(key: RoutingKey, matched: int) -> int:
    """Estimated prompt tokens a prefill must compute for ``key`` when its tree matched ``matched`` units."""
    return key_tokens(key[matched:])


def choose_prefill(views: Sequence[PrefillView], key: RoutingKey, cfg: CacheAwareConfig) -> int:
    """The index of the prefill for ``key`` (``views`` is non-empty). See the module docstring."""
    costs = [v.load_tokens + uncached_tokens(key, v.matched) for v in views]
    cheapest = min(range(len(views)), key=lambda i: (costs[i], -views[i].matched, views[i].tree_units, i))
    preferred = min(range(len(views)), key=lambda i: (-views[i].matched, costs[i], views[i].tree_units, i))
    if not key or views[preferred].matched / len(key) <= cfg.cache_threshold:
        return cheapest
    if imbalanced(costs[cheapest], costs[preferred], cfg):
        return cheapest
    return preferred


def imbalanced(low: int, high: int, cfg: CacheAwareConfig) -> bool:
    """smg's test (``is_imbalanced``): the spread exceeds the absolute AND the relative threshold."""
    return high - low > cfg.balance_abs_threshold and high > cfg.balance_rel_threshold * low
