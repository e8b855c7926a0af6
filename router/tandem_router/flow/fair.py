"""The admission core, pure: per-tenant queues in front of the pairs, served by weighted fair sharing of the
cluster's capacity, strict priority between classes, and the per-tenant limits.

- **Capacity** ``C`` (requests the decodes run at once, learned: ``capacity``) bounds what is admitted. Unknown
  (nothing learned yet): everything is admitted at once, as without flow control.
- **Shares**: a busy tenant's share is ``(C + H) * weight / (sum of the weights of tenants with requests in flight
  or queued)``: an idle tenant's share goes to the others (work-conserving). A tenant below its share may be
  admitted while fewer than ``C + H`` requests are in flight; one at or above it only while fewer than ``C - R``.
  The headroom ``H`` (``headroom_share`` of ``C``) keeps a short queue on the workers, so that the next requests'
  prefills and KV transfers overlap the running ones' decoding (without it a decode slot waits out a whole prefill
  between two requests) and the workers' ``queued`` gauge keeps confirming the capacity; a tenant alone is never
  above its share, so it gets all of ``C + H``. ``H`` is also what a newcomer finds queued on the decodes ahead of
  its first request (a decode serves its queue in arrival order): 0.25 of ``C`` held a lone flood at 0.9x of its
  throughput without flow control on a loaded machine, 0.5 at 1.11x (median of 6 pairs of runs). The reserve ``R``
  (``reserve_share`` of ``C``, at least 1 unless that share is 0) keeps decode slots free for tenants below their
  share while others are above theirs, so their requests start at once instead of waiting on a full decode behind
  a flood's.
- **Linger**: a tenant whose last request ended stays counted busy for ``linger_s`` (``release`` with ``now``;
  ``expire`` ends it), so a quiet tenant between two requests, or whose client stalls a moment, keeps its share: a
  flood let up to ``C + H`` in that moment would hold those slots for a whole request, and the quiet tenant's next
  requests would wait them out (measured: the slowest 2 % of quiet requests under a flood). Idle longer, its share
  goes to the others. The same holds for its slots: a tenant below its share holds the slots it used within the
  last ``linger_s`` (its demand, at most its share) and does not use now, so a tenant above its share is let in
  only below ``C - R - held``: when the quiet tenants' streams come back, their requests find free decode slots
  instead of queueing on a decode behind the flood's, and the reserve is still there for a newcomer.
- **Order** when a slot frees: the highest priority at the head of any tenant's queue, then the tenant with the
  fewest requests in flight per weight, then the least service per weight (a virtual token counter, AIBrix's VTC:
  estimated tokens / weight; a tenant that becomes busy starts at the busy tenants' lowest counter, so idle time is
  not banked). Within a tenant: priority, then arrival.
- **Limits** (``limits.TenantLimits``), checked on arrival: requests in flight or queued (``max_concurrency``),
  queue length (``max_queued``), requests per minute and estimated tokens per second (token buckets; the tokens
  one, charged on arrival, may go into debt so that one large request is not refused forever). A refusal carries
  the seconds after which a retry can pass (``Retry-After``). A queued request past ``queue_timeout_s`` is the
  adapter's to refuse (``cancel``).

Busy tenants are scanned per decision (O(busy tenants)): the queue only fills while the cluster is saturated.
"""

from __future__ import annotations

import heapq
import math
from dataclasses import dataclass, field
from enum import StrEnum
from itertools import count

from tandem_router.flow.limits import FlowLimits, TenantLimits

IDLE_TENANTS_KEPT = 4096  # idle tenants' state (counters, buckets) kept before the idle ones are dropped


class Reason(StrEnum):
    CONCURRENCY = "concurrency"
    QUEUE_FULL = "queue_full"
    REQUESTS_PER_MINUTE = "requests_per_minute"
    TOKENS_PER_SECOND = "tokens_per_second"
    QUEUE_TIMEOUT = "queue_timeout"


@dataclass(frozen=True)
class Rejection:
    reason: Reason
    retry_after_s: float
    message: str


@dataclass(eq=False)
class Pending:
    """One request from arrival to release: queued, then admitted (``admitted``), then released."""

    tenant: str
    priority: int
    cost: float
    timeout_s: float
    seq: int
    admitted: bool = False
    done: bool = False


@dataclass
class _Bucket:
    rate: float  # per second
    size: float
    level: float
    stamp: float

    def refill(self, now: float) -> None:
        self.level = min(self.size, self.level + (now - self.stamp) * self.rate)
        self.stamp = now


@dataclass(eq=False)
class _Tenant:
    name: str
    limits: TenantLimits
    in_flight: int = 0
    queue: list[tuple[int, int, Pending]] = field(default_factory=list)  # heap: (-priority, seq, request)
    served: float = 0.0  # estimated tokens admitted / weight (VTC)
    peak: int = 0  # most requests in flight at once lately (``FairQueue.demand``)
    peak_at: float = -math.inf
    rpm: _Bucket | None = None
    tps: _Bucket | None = None

    @property
    def busy(self) -> bool:
        return self.in_flight > 0 or bool(self.queue)


class FairQueue:
    def __init__(
        self,
        limits: FlowLimits | None = None,
        reserve_share: float = 0.25,
        headroom_share: float = 0.5,
        linger_s: float = 0.0,
    ) -> None:
        self.reserve_share = reserve_share
        self.headroom_share = headroom_share
        self.linger_s = linger_s
        self._lingering: dict[str, float] = {}  # idle tenants still counted busy (``release``): name -> until
        self._now = 0.0  # the latest time a caller gave (``offer``, ``release``, ``expire``)
        self.capacity: int | None = None
        self.in_flight = 0
        self.queued = 0
        self.tenants: dict[str, _Tenant] = {}
        self._busy: dict[str, _Tenant] = {}
        self._busy_weight = 0.0
        self._seq = count()
        self.set_limits(limits or FlowLimits())

    # -- configuration ---------------------------------------------------------------------------------------
    def set_limits(self, limits: FlowLimits) -> list[Pending]:
        """New limits for every tenant (a reload): buckets keep their levels where their rate is unchanged."""
        self.limits = limits
        self._named = limits.resolved()
        for name, t in self.tenants.items():
            counted = name in self._busy
            self._busy_weight -= t.limits.weight if counted else 0.0
            t.limits = self.limits_of(name)
            self._busy_weight += t.limits.weight if counted else 0.0
            t.rpm = _rebucket(t.rpm, t.limits.requests_per_minute, 60.0)
            t.tps = _rebucket(t.tps, t.limits.tokens_per_second, 1.0)
        return self.dispatch()

    def limits_of(self, tenant: str) -> TenantLimits:
        return self._named.get(tenant, self.limits.default)

    def set_capacity(self, capacity: int | None) -> list[Pending]:
        """The learned capacity (None: unknown, admit everything); returns the requests it lets in."""
        self.capacity = capacity
        return self.dispatch()

    @property
    def headroom(self) -> int:
        return 0 if self.capacity is None else math.ceil(self.capacity * self.headroom_share)

    @property
    def reserve(self) -> int:
        if self.capacity is None or self.reserve_share <= 0:
            return 0
        return max(1, math.ceil(self.capacity * self.reserve_share))

    # -- requests ----------------------------------------------------------------------------------------------
    def offer(self, tenant: str, asked_priority: int | None, cost: float, now: float) -> Pending | Rejection:
        """A request arrives: refused (a limit), admitted at once (``admitted``) or queued."""
        self._now = now
        t = self.tenants.get(tenant) or self._new_tenant(tenant, now)
        lim = t.limits
        if lim.max_concurrency is not None and t.in_flight + len(t.queue) >= lim.max_concurrency:
            return Rejection(Reason.CONCURRENCY, 1.0, f"tenant limit of {lim.max_concurrency} concurrent requests")
        at_once = not self.queued and self._fits(t)  # the common case, nothing waiting: no heap, no scan
        if not at_once and len(t.queue) >= lim.max_queued:
            return Rejection(Reason.QUEUE_FULL, 1.0, f"tenant queue is full ({lim.max_queued} requests waiting)")
        if t.rpm is not None and (wait := _take(t.rpm, 1.0, now, debt=False)) is not None:
            return Rejection(Reason.REQUESTS_PER_MINUTE, wait, f"tenant limit of {t.rpm.size:g} requests/minute")
        if t.tps is not None and (wait := _take(t.tps, cost, now, debt=True)) is not None:
            return Rejection(Reason.TOKENS_PER_SECOND, wait, f"tenant limit of {t.tps.size:g} tokens/second")
        if self._lingering:
            self._lingering.pop(tenant, None)  # back before its share lapsed: busy again
        p = Pending(tenant, lim.effective_priority(asked_priority), cost, lim.queue_timeout_s, next(self._seq))
        if at_once:
            self._admit(t, p)
            return p
        self._enqueue(t, p)
        self.dispatch()
        return p

    def release(self, p: Pending, now: float | None = None) -> list[Pending]:
        """An admitted request is over (once); returns the requests its slot lets in. With ``now``, a tenant it
        leaves idle keeps its share for ``linger_s`` more (``expire``)."""
        if p.done or not p.admitted:
            return []
        p.done = True
        if now is not None:
            self._now = now
        t = self.tenants[p.tenant]
        t.in_flight -= 1
        self.in_flight -= 1
        self._settle(t, now)
        return self.dispatch() if self.queued else []

    def expire(self, now: float) -> list[Pending]:
        """Idle tenants whose linger is over stop counting, slots held past it are let go; returns the requests
        their shares and slots let in."""
        self._now = now  # tenants' demand (``held``) lapses with time too: the queue is looked at either way
        for name, until in list(self._lingering.items()):
            if until <= now:
                del self._lingering[name]
                t = self._busy.get(name)
                if t is not None and not t.busy:
                    self._drop(t)
        return self.dispatch() if self.queued else []

    def cancel(self, p: Pending) -> None:
        """A queued request gave up (its deadline passed, or its client left)."""
        if p.admitted or p.done:
            return
        p.done = True
        t = self.tenants[p.tenant]
        t.queue = [e for e in t.queue if e[2] is not p]
        heapq.heapify(t.queue)
        self.queued -= 1
        self._settle(t)

    def dispatch(self) -> list[Pending]:
        """Admit waiting requests in fair order while they fit."""
        admitted: list[Pending] = []
        while self.queued:
            t = self._next()
            if t is None:
                break
            _, _, p = heapq.heappop(t.queue)
            self.queued -= 1
            self._admit(t, p)
            admitted.append(p)
        return admitted

    def queued_by_priority(self) -> dict[int, int]:
        out: dict[int, int] = {}
        for t in self._busy.values():
            for neg, _, _ in t.queue:
                out[-neg] = out.get(-neg, 0) + 1
        return out

    # -- internals ---------------------------------------------------------------------------------------------
    def share(self, t: _Tenant) -> float:
        if self.capacity is None:
            return math.inf
        weight = self._busy_weight if t.name in self._busy else self._busy_weight + t.limits.weight
        return (self.capacity + self.headroom) * t.limits.weight / weight

    def demand(self, t: _Tenant) -> int:
        """The most requests ``t`` had in flight at once within the last ``linger_s`` (at least those it has)."""
        return t.peak if self._now - t.peak_at <= self.linger_s else t.in_flight

    def held(self) -> int:
        """Slots that tenants below their share used lately and do not use now (``demand``, at most the share)."""
        out = 0
        for u in self._busy.values():
            share = self.share(u)
            if u.in_flight < share:
                out += max(0, min(self.demand(u), math.floor(share)) - u.in_flight)
        return out

    def _fits(self, t: _Tenant, held: int | None = None) -> bool:
        if self.capacity is None:
            return True
        if t.in_flight < self.share(t):
            return self.in_flight < self.capacity + self.headroom
        if self.in_flight >= self.capacity - self.reserve:
            return False
        return self.in_flight < self.capacity - self.reserve - (self.held() if held is None else held)

    def _next(self) -> _Tenant | None:
        best: _Tenant | None = None
        best_key: tuple[int, float, float] | None = None
        held = self.held() if self.capacity is not None else 0
        for t in self._busy.values():
            if not t.queue or not self._fits(t, held):
                continue
            key = (t.queue[0][0], t.in_flight / t.limits.weight, t.served)
            if best_key is None or key < best_key:
                best, best_key = t, key
        return best

    def _admit(self, t: _Tenant, p: Pending) -> None:
        if t.name not in self._busy:  # not ``t.busy``: a request just taken off its queue left it looking idle
            self._activate(t)
        p.admitted = True
        t.in_flight += 1
        self.in_flight += 1
        if t.in_flight >= self.demand(t):
            t.peak, t.peak_at = t.in_flight, self._now
        t.served += p.cost / t.limits.weight

    def _enqueue(self, t: _Tenant, p: Pending) -> None:
        if t.name not in self._busy:
            self._activate(t)
        heapq.heappush(t.queue, (-p.priority, p.seq, p))
        self.queued += 1

    def _activate(self, t: _Tenant) -> None:
        """``t`` becomes busy: it starts at the busy tenants' lowest counter (no credit for idle time)."""
        if self._busy:
            t.served = max(t.served, min(b.served for b in self._busy.values()))
        self._busy_weight += t.limits.weight
        self._busy[t.name] = t

    def _settle(self, t: _Tenant, now: float | None = None) -> None:
        if t.busy or t.name not in self._busy:
            return
        if now is not None and self.linger_s > 0:
            self._lingering[t.name] = now + self.linger_s
            return
        self._drop(t)

    def _drop(self, t: _Tenant) -> None:
        del self._busy[t.name]
        self._lingering.pop(t.name, None)
        self._busy_weight -= t.limits.weight
        if not self._busy:
            self._busy_weight = 0.0  # no drift from float sums

    def _new_tenant(self, name: str, now: float) -> _Tenant:
        if len(self.tenants) >= IDLE_TENANTS_KEPT + len(self._busy):
            for idle in [n for n in self.tenants if n not in self._busy]:
                del self.tenants[idle]
        lim = self.limits_of(name)
        t = _Tenant(name, lim)
        t.rpm = _rebucket(None, lim.requests_per_minute, 60.0, now)
        t.tps = _rebucket(None, lim.tokens_per_second, 1.0, now)
        self.tenants[name] = t
        return t


def _rebucket(old: _Bucket | None, per: float | None, seconds: float, now: float | None = None) -> _Bucket | None:
    """A bucket refilled at ``per`` every ``seconds`` holding ``per`` (one period's burst); None: no limit."""
    if per is None:
        return None
    rate = per / seconds
    if old is not None and old.rate == rate:
        return old
    stamp = old.stamp if old is not None else (now or 0.0)
    level = per if old is None else min(per, old.level)
    return _Bucket(rate, per, level, stamp)


def _take(bucket: _Bucket, amount: float, now: float, *, debt: bool) -> float | None:
    """Charge ``amount``, or the seconds until it can be: refused while the bucket holds less (``debt``: while it
    is empty or in debt; a charge may then take it below zero, and the debt is paid back before the next)."""
    bucket.refill(now)
    short = (1e-6 - bucket.level) if debt else (amount - bucket.level)
    if short > 0:
        return short / bucket.rate
    bucket.level -= amount
    return None
