"""When to try a request again on another pair, and how long to wait first."""

from __future__ import annotations

import random
from dataclasses import dataclass

# Statuses SGLang's own router retries (reference §1): timeout, overload, and server/gateway errors.
RETRYABLE_STATUSES = frozenset({408, 429, 500, 502, 503, 504})


@dataclass(frozen=True)
class RetryConfig:
    max_attempts: int = 5  # total tries, the first included
    initial_backoff: float = 0.01
    multiplier: float = 1.5
    max_backoff: float = 0.5
    jitter: float = 0.2  # +-20 %


def is_retryable_status(status: int) -> bool:
    return status in RETRYABLE_STATUSES


def should_retry(attempt: int, cfg: RetryConfig, *, first_byte_sent: bool) -> bool:
    """``attempt`` is the number of tries already made (1 after the first). Never after a byte reached the client."""
    return not first_byte_sent and attempt < cfg.max_attempts


def backoff(attempt: int, cfg: RetryConfig, rng: random.Random) -> float:
    """Seconds to wait before try ``attempt + 1``: exponential from ``initial_backoff``, capped, with jitter."""
    base = min(cfg.initial_backoff * cfg.multiplier ** max(attempt - 1, 0), cfg.max_backoff)
    return max(0.0, base * (1.0 + rng.uniform(-cfg.jitter, cfg.jitter)))
