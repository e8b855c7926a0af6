"""Circuit breakers, one per worker and one per (prefill, decode) pair, as a pure state machine.

closed --(``threshold`` consecutive failures)--> open --(``cooldown`` elapsed)--> half-open (one trial request)
half-open --success--> closed; half-open --failure--> open again with a doubled cooldown (up to ``max_cooldown``).
Time is passed in (monotonic seconds), so the transitions are table-tested without sleeping.
"""

from __future__ import annotations

from dataclasses import dataclass, replace
from enum import StrEnum


class BreakerState(StrEnum):
    CLOSED = "closed"
    OPEN = "open"
    HALF_OPEN = "half_open"


@dataclass(frozen=True)
class BreakerConfig:
    threshold: int = 5
    cooldown: float = 2.0
    max_cooldown: float = 30.0


@dataclass(frozen=True)
class Breaker:
    state: BreakerState = BreakerState.CLOSED
    failures: int = 0
    opened_at: float = 0.0
    cooldown: float = 0.0
    trial_in_flight: bool = False


def allows(b: Breaker, now: float) -> bool:
    """May a request go through right now? (An open breaker whose cooldown elapsed admits one trial.)"""
    if b.state is BreakerState.CLOSED:
        return True
    if b.state is BreakerState.OPEN:
        return now - b.opened_at >= b.cooldown
    return not b.trial_in_flight


def on_dispatch(b: Breaker, now: float) -> Breaker:
    """A request was sent through: an open breaker past its cooldown turns half-open with its trial in flight."""
    if b.state is BreakerState.OPEN and now - b.opened_at >= b.cooldown:
        return replace(b, state=BreakerState.HALF_OPEN, trial_in_flight=True)
    if b.state is BreakerState.HALF_OPEN:
        return replace(b, trial_in_flight=True)
    return b


def on_success(b: Breaker) -> Breaker:
    return Breaker()


def on_failure(b: Breaker, now: float, cfg: BreakerConfig) -> Breaker:
    if b.state is BreakerState.HALF_OPEN:
        return Breaker(BreakerState.OPEN, b.failures + 1, now, min(b.cooldown * 2, cfg.max_cooldown))
    failures = b.failures + 1
    if b.state is BreakerState.CLOSED and failures >= cfg.threshold:
        return Breaker(BreakerState.OPEN, failures, now, cfg.cooldown)
    if b.state is BreakerState.OPEN:
        return replace(b, failures=failures, opened_at=now)
    return replace(b, failures=failures)


def force_open(b: Breaker, now: float, cfg: BreakerConfig) -> Breaker:
    """Open at once (a failed active health check or a connection refused: no need to wait for ``threshold``)."""
    cooldown = (
        cfg.cooldown if b.state is BreakerState.CLOSED else min(max(b.cooldown, cfg.cooldown) * 2, cfg.max_cooldown)
    )
    return Breaker(BreakerState.OPEN, max(b.failures, cfg.threshold), now, cooldown)
