"""One worker and one pair as the router addresses them, and the vetoes on pairs: data and per-pair breakers.

``WorkerSpec`` is a serving group as discovery reports it (registry entry, pod or flag), ``WorkerState`` what the
router knows of it, ``Pair`` one (prefill, decode) choice. ``PairGate`` is the seam for vetoes beyond health (the
pair breakers here, integrity quarantine): ``pool.WorkerPool`` asks every gate before it offers a pair.
"""

from __future__ import annotations

import functools
from dataclasses import dataclass, field
from typing import Protocol

from tandem.registry import Role
from tandem_router.policy import breaker as br
from tandem_router.policy import selection as sel
from tandem_router.policy.load import WorkerLoad


@dataclass(frozen=True)
class WorkerSpec:
    """One serving group as the router addresses it (the rank-0 server of a prefill or decode group)."""

    role: Role
    url: str
    bootstrap_port: int | None = None  # prefill only; None means "the prefill's own default"
    attn_dp_size: int = 1
    model: str | None = None  # served model name when known (registry), else learned from /v1/models
    epoch: int = 0
    revision: str = ""  # compatibility revision (model, image, transfer); "" when the source does not say
    fabric_domain: str | None = None  # RDMA fabric domain (registry); None: unknown
    fabric_required: bool = False  # its registry entry asks for pairs within its domain only (spec.fabric.mode)

    @functools.cached_property
    def key(self) -> str:  # computed once: every decision and outcome looks workers up by it
        return f"{self.role.value}:{self.url}"


@dataclass
class WorkerState:
    spec: WorkerSpec
    in_flight: int = 0
    load: WorkerLoad = field(default_factory=WorkerLoad)
    breaker: br.Breaker = field(default_factory=br.Breaker)
    models: frozenset[str] = frozenset()
    unreachable: bool = False  # its last failure was a refused connection: the process was gone
    prefill_tokens: int = 0  # prefill: estimated uncached prompt tokens of the requests it is prefilling now
    rank_in_flight: list[int] = field(default_factory=list)  # decode with attention DP: requests per DP rank

    def __post_init__(self) -> None:
        self.rank_in_flight = [0] * self.spec.attn_dp_size if self.spec.attn_dp_size > 1 else []

    def candidate(self) -> sel.Candidate:
        return sel.Candidate(self.spec.key, self.in_flight, self.load.kv_usage, int(self.load.queued))


@dataclass(frozen=True)
class Pair:
    prefill: WorkerSpec
    decode: WorkerSpec
    # The request's estimated uncached prompt tokens on this prefill: its prefill load while the pair is dispatched.
    prefill_tokens: int = field(default=0, compare=False)
    # The decode's attention-DP rank for the request (sent to the decode alone as ``routed_dp_rank``); None: the
    # decode has no attention DP, or the policy leaves the rank to the decode.
    decode_dp_rank: int | None = field(default=None, compare=False)

    @functools.cached_property
    def key(self) -> tuple[str, str]:
        return (self.prefill.key, self.decode.key)


def same_revision(pair: Pair) -> bool:
    """A prefill's KV layout and transfer must match its decode's: pair only equal compatibility revisions."""
    return pair.prefill.revision == pair.decode.revision


class PairGate(Protocol):
    """A veto on pairs: ``allows`` is asked before a pair is offered; ``record`` hears every outcome."""

    def allows(self, pair: Pair, now: float) -> bool: ...

    def record(self, pair: Pair, ok: bool, now: float) -> None: ...


class PairBreakers:
    """A circuit breaker per (prefill, decode) pair: a pair can fail (e.g. a blacklisted Mooncake session) while
    both of its workers serve other pairs fine."""

    def __init__(self, cfg: br.BreakerConfig) -> None:
        self.cfg = cfg
        self.breakers: dict[tuple[str, str], br.Breaker] = {}

    def allows(self, pair: Pair, now: float) -> bool:
        b = self.breakers.get(pair.key)
        return b is None or br.allows(b, now)

    def dispatched(self, pair: Pair, now: float) -> None:
        b = self.breakers.get(pair.key)
        if b is not None:
            self.breakers[pair.key] = br.on_dispatch(b, now)

    def record(self, pair: Pair, ok: bool, now: float) -> None:
        if ok:
            self.breakers.pop(pair.key, None)
        else:
            self.breakers[pair.key] = br.on_failure(self.breakers.get(pair.key, br.Breaker()), now, self.cfg)

    def forget(self, worker_key: str) -> None:
        for key in [k for k in self.breakers if worker_key in k]:
            del self.breakers[key]
