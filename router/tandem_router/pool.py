"""The router's view of its workers: who exists, how loaded, whether they and their pairs may take traffic.

Mutable state, but no I/O: discovery adds and removes workers, the proxy reports dispatches and outcomes, the
health checker reports probes and scraped load, and ``choose_pair`` turns a snapshot into a decision with the
pure policies. Everything runs on the event loop thread, so no locks.

``PairGate`` is the seam for vetoes beyond health (e.g. integrity quarantine of a pair): the pool asks every gate
before it offers a pair, and tells every gate each pair outcome. Before any gate, a prefill and a decode pair only
when their ``revision``s are equal (``same_revision``): during a rollout of the model or worker image, old pairs
with old and new with new, never across. The fabric locality (``policy.fabric``) ranks pairs within one RDMA
fabric domain first (``preferred``) or forms no other pair (``required``).
"""

from __future__ import annotations

import random
from collections.abc import Collection, Iterable, Sequence

from tandem.registry import Role
from tandem.registry_versions import SchemaCensus
from tandem_router.policy import breaker as br
from tandem_router.policy import cache_aware as ca
from tandem_router.policy import fabric as fab
from tandem_router.policy import selection as sel
from tandem_router.policy.prefix_tree import PrefixTree, RoutingKey
from tandem_router.registry_guard import RegistryGuard
from tandem_router.workers import Pair as Pair
from tandem_router.workers import PairBreakers
from tandem_router.workers import PairGate as PairGate
from tandem_router.workers import WorkerSpec as WorkerSpec
from tandem_router.workers import WorkerState as WorkerState
from tandem_router.workers import same_revision as same_revision


class Lease:
    """One dispatch of a pair: counted in flight from ``WorkerPool.lease`` until ``release``, and the one way its
    outcomes reach the worker and pair breakers and the gates."""

    def __init__(self, pool: WorkerPool, pair: Pair, now: float) -> None:
        self.pool = pool
        self.pair = pair
        self._held = True
        self._prefilling = True
        pool.dispatched(pair, now)

    def failed(self, role: Role, now: float, *, hard: bool = False) -> None:
        """The ``role`` side failed this dispatch: that worker and the pair count a failure (``hard``: the worker is
        gone, its breaker opens at once)."""
        self.pool.record_worker(self.pair.prefill if role is Role.PREFILL else self.pair.decode, False, now, hard=hard)
        self.pool.record_pair(self.pair, False, now)

    def prefilled(self) -> None:
        """The prefill part is over (the decode's first chunk came, or the attempt ended); only the first call
        counts."""
        if self._prefilling:
            self._prefilling = False
            self.pool.prefilled(self.pair)

    def prefill_ok(self, now: float) -> None:
        self.pool.record_worker(self.pair.prefill, True, now)

    def release(self, now: float, *, ok: bool | None = None) -> None:
        """The dispatch is over (only the first call counts). ``ok``: the decode and the pair served (True) or failed
        (False); None: no verdict (it never started, or the client left)."""
        if not self._held:
            return
        self._held = False
        self.prefilled()
        self.pool.finished(self.pair)
        if ok is not None:
            self.pool.record_worker(self.pair.decode, ok, now)
            self.pool.record_pair(self.pair, ok, now)


class WorkerPool:
    def __init__(
        self,
        policy: sel.Policy = sel.Policy.CACHE_AWARE,
        breaker_cfg: br.BreakerConfig | None = None,
        rng: random.Random | None = None,
        gates: Sequence[PairGate] = (),
        cache_cfg: ca.CacheAwareConfig | None = None,
        fabric: fab.FabricLocality = fab.FabricLocality.AUTO,
    ) -> None:
        self.policy = policy
        self.fabric = fabric
        self.fabric_choices = dict.fromkeys(fab.Locality, 0)  # pairs chosen, by where their workers are
        self.cache_cfg = cache_cfg or ca.CacheAwareConfig()
        self.trees: dict[str, PrefixTree] = {}  # prefill key -> what it was sent (cache_aware only)
        self.breaker_cfg = breaker_cfg or br.BreakerConfig()
        self.rng = rng or random.Random()
        self.workers: dict[str, WorkerState] = {}
        self.pair_breakers = PairBreakers(self.breaker_cfg)
        self.gates: list[PairGate] = [self.pair_breakers, *gates]
        self._rr_k = -1
        self._rr_prefills = 1
        self.mooncake_session_reuses = 0  # recreated groups that came back under an earlier Mooncake session id
        self.forged_endpoints = 0  # registry values ignored for lack of a valid operator signature
        self.registry_guard: RegistryGuard | None = None  # etcd discovery's removal-storm guard (metrics, readiness)
        self.registry_census: SchemaCensus | None = None  # etcd discovery's entries by schema relation (metrics)

    # -- membership (discovery) --------------------------------------------------------------------------------
    def upsert(self, spec: WorkerSpec) -> None:
        """Add a worker, or replace one whose spec changed (a recreated group: new epoch, fresh state)."""
        current = self.workers.get(spec.key)
        if current is None or current.spec != spec:
            self.workers[spec.key] = WorkerState(spec)
            self.pair_breakers.forget(spec.key)
            self.trees.pop(spec.key, None)  # a new process (or group) starts with an empty prefix cache

    def remove(self, key: str) -> None:
        self.workers.pop(key, None)
        self.pair_breakers.forget(key)
        self.trees.pop(key, None)

    def restore(self, state: WorkerState) -> None:
        """Put back a worker removed moments ago, with its breaker, load and models (a registry removal storm)."""
        self.workers.setdefault(state.spec.key, state)

    def replace_all(self, specs: Iterable[WorkerSpec]) -> None:
        wanted = {s.key: s for s in specs}
        for key in [k for k in self.workers if k not in wanted]:
            self.remove(key)
        for spec in wanted.values():
            self.upsert(spec)

    def of_role(self, role: Role) -> list[WorkerState]:
        return [w for w in self.workers.values() if w.spec.role is role]

    def all_pairs(self) -> list[Pair]:
        """Every (prefill, decode) pair the members can form, whatever their health or gates (the fabric mode
        forms no pair across domains where it requires one domain: canaries and mirrors never try one)."""
        return [
            Pair(p.spec, d.spec)
            for p in self.of_role(Role.PREFILL)
            for d in self.of_role(Role.DECODE)
            if self._tier(p.spec, d.spec) is not None
        ]

    def can_pair(self, prefill: WorkerSpec, decode: WorkerSpec) -> bool:
        """Whether the two may form a pair at all: one revision, and the fabric mode allows it."""
        return prefill.revision == decode.revision and self._tier(prefill, decode) is not None

    def pairs_with(self, workers: Collection[str]) -> frozenset[tuple[str, str]]:
        """The keys of every pair that has one of ``workers`` (worker keys) in it: what a request avoids after
        those workers failed it."""
        if not workers:
            return frozenset()
        return frozenset(p.key for p in self.all_pairs() if p.prefill.key in workers or p.decode.key in workers)

    def models(self) -> set[str]:
        names: set[str] = set()
        for w in self.workers.values():
            names |= w.models
            if w.spec.model:
                names.add(w.spec.model)
        return names

    def serves(self, model: str, also: Collection[str] = ()) -> bool:
        """Whether a request for ``model`` may be routed: a worker (or ``also``) names it, or nothing names any
        model. ``model in self.models()`` without building the set on every request."""
        if model in also:
            return True
        named = bool(also)
        for w in self.workers.values():
            if model in w.models or model == w.spec.model:
                return True
            named = named or bool(w.models) or bool(w.spec.model)
        return not named

    # -- decisions ---------------------------------------------------------------------------------------------
    def available(self, role: Role, now: float) -> list[WorkerState]:
        return [w for w in self.of_role(role) if br.allows(w.breaker, now)]

    def has_healthy_pair(self, now: float) -> bool:
        return any(
            self._pair_allowed(Pair(p.spec, d.spec), now)
            for p in self.available(Role.PREFILL, now)
            for d in self.available(Role.DECODE, now)
        )

    def fabric_refuses(self, now: float) -> bool:
        """No pair may be chosen now, yet a healthy one would be if the fabric mode allowed pairs across domains:
        the request is refused for want of a pair within one domain."""
        if self.has_healthy_pair(now):
            return False
        decodes = self.available(Role.DECODE, now)
        return any(
            self._admitted(Pair(p.spec, d.spec), now) for p in self.available(Role.PREFILL, now) for d in decodes
        )

    def choose_pair(
        self, key: RoutingKey, now: float, exclude: frozenset[tuple[str, str]] = frozenset()
    ) -> Pair | None:
        """Pick a pair neither of whose workers is open-circuited, that every gate allows and that is not in
        ``exclude`` (the pairs this request already failed on). None when there is none: never decode alone.
        ``key`` is the request's prompt prefix (token ids or text) for the cache-aware prefill choice.
        Pairs within one fabric domain come first: pairs across domains are looked at only when none is left."""
        prefills = self.available(Role.PREFILL, now)
        decodes = self.available(Role.DECODE, now)
        matched = self._matches(prefills, key)
        pair, cross = self._choose(key, now, exclude, list(prefills), decodes, list(matched), fab.Tier.SAME)
        if pair is None and cross:
            pair, _ = self._choose(key, now, exclude, prefills, decodes, matched, fab.Tier.CROSS)
        if pair is not None:
            self.fabric_choices[fab.locality(pair.prefill.fabric_domain, pair.decode.fabric_domain)] += 1
        return pair

    def _choose(
        self,
        key: RoutingKey,
        now: float,
        exclude: frozenset[tuple[str, str]],
        prefills: list[WorkerState],
        decodes: Sequence[WorkerState],
        matched: list[int],
        max_tier: fab.Tier,
    ) -> tuple[Pair | None, bool]:
        """The policy's pick among pairs of at most ``max_tier``, and whether a pair was passed over for its tier
        alone (consumes ``prefills`` and ``matched``)."""
        passed_over = False
        while prefills and decodes:
            i = self._pick_prefill(prefills, matched, key)
            p = prefills[i]
            allowed: list[WorkerState] = []
            pairs: list[Pair] = []  # the pair of each allowed decode (its key computed once, for the lease too)
            for d in decodes:
                pair = Pair(p.spec, d.spec)
                if pair.key in exclude or (tier := self._tier(p.spec, d.spec)) is None:
                    continue
                if tier > max_tier:
                    passed_over = True
                elif self._admitted(pair, now):
                    allowed.append(d)
                    pairs.append(pair)
            if allowed:
                j = self._pick(Role.DECODE, allowed)
                if self.policy is not sel.Policy.CACHE_AWARE:
                    return pairs[j], passed_over
                d = allowed[j]
                self._tree(p.spec.key).insert(key)
                rank = sel.least_loaded_rank(d.rank_in_flight) if d.rank_in_flight else None
                return Pair(p.spec, d.spec, ca.uncached_tokens(key, matched[i]), rank), passed_over
            del prefills[i], matched[i]
        return None, passed_over

    def _tree(self, prefill_key: str) -> PrefixTree:
        tree = self.trees.get(prefill_key)
        if tree is None:
            tree = self.trees[prefill_key] = PrefixTree(self.cache_cfg.max_tree_units)
        return tree

    def _matches(self, prefills: Sequence[WorkerState], key: RoutingKey) -> list[int]:
        """Units of ``key`` each prefill's tree matches (0 for all unless cache_aware)."""
        if self.policy is not sel.Policy.CACHE_AWARE:
            return [0] * len(prefills)
        return [self._tree(p.spec.key).match(key) for p in prefills]

    def _pick_prefill(self, prefills: Sequence[WorkerState], matched: Sequence[int], key: RoutingKey) -> int:
        if self.policy is not sel.Policy.CACHE_AWARE:
            return self._pick(Role.PREFILL, prefills)
        views = [
            ca.PrefillView(m, p.prefill_tokens, self._tree(p.spec.key).units)
            for p, m in zip(prefills, matched, strict=True)
        ]
        return ca.choose_prefill(views, key, self.cache_cfg)

    def _pair_allowed(self, pair: Pair, now: float) -> bool:
        return self._tier(pair.prefill, pair.decode) is not None and self._admitted(pair, now)

    def _admitted(self, pair: Pair, now: float) -> bool:
        return same_revision(pair) and all(gate.allows(pair, now) for gate in self.gates)

    def _tier(self, prefill: WorkerSpec, decode: WorkerSpec) -> fab.Tier | None:
        return fab.pair_tier(
            self.fabric, prefill.fabric_domain, decode.fabric_domain, prefill.fabric_required, decode.fabric_required
        )

    def _pick(self, role: Role, workers: Sequence[WorkerState]) -> int:
        if self.policy is sel.Policy.ROUND_ROBIN:
            # Pair counter k: prefill k % P, decode (k // P) % D, so every P * D successive requests walk each
            # (prefill, decode) combination once and every worker gets an equal share, whatever P and D are.
            if role is Role.PREFILL:
                self._rr_k += 1
                self._rr_prefills = len(workers)
                return sel.round_robin(len(workers), self._rr_k)
            return sel.round_robin(len(workers), self._rr_k // max(self._rr_prefills, 1))
        if self.policy is sel.Policy.RANDOM:
            return self.rng.randrange(len(workers))
        candidates = [w.candidate() for w in workers]  # only the load-aware policies look at the load
        if self.policy is sel.Policy.POWER_OF_TWO:
            return sel.power_of_two(candidates, self.rng)
        return sel.load_aware_decode(candidates)  # cache_aware: its prefill is chosen by _pick_prefill

    # -- outcomes ----------------------------------------------------------------------------------------------
    def lease(self, pair: Pair, now: float) -> Lease:
        """Dispatch a request to ``pair``: what the proxy holds until the request is over."""
        return Lease(self, pair, now)

    def dispatched(self, pair: Pair, now: float) -> None:
        """``pair`` took a request: both workers have one more in flight, the prefill its tokens to compute."""
        for spec in (pair.prefill, pair.decode):
            w = self.workers.get(spec.key)
            if w is not None:
                w.in_flight += 1
                w.breaker = br.on_dispatch(w.breaker, now)
        if (p := self.workers.get(pair.prefill.key)) is not None:
            p.prefill_tokens += pair.prefill_tokens
        self._count_rank(pair, +1)
        self.pair_breakers.dispatched(pair, now)

    def _count_rank(self, pair: Pair, delta: int) -> None:
        d = self.workers.get(pair.decode.key)
        if pair.decode_dp_rank is not None and d is not None and pair.decode_dp_rank < len(d.rank_in_flight):
            d.rank_in_flight[pair.decode_dp_rank] = max(0, d.rank_in_flight[pair.decode_dp_rank] + delta)

    def prefilled(self, pair: Pair) -> None:
        """The prefill part of a request dispatched to ``pair`` is over (the decode's first chunk came, or the
        attempt ended): its tokens no longer load the prefill."""
        if (p := self.workers.get(pair.prefill.key)) is not None:
            p.prefill_tokens = max(0, p.prefill_tokens - pair.prefill_tokens)

    def finished(self, pair: Pair) -> None:
        for spec in (pair.prefill, pair.decode):
            w = self.workers.get(spec.key)
            if w is not None:
                w.in_flight = max(0, w.in_flight - 1)
        self._count_rank(pair, -1)

    def record_worker(self, spec: WorkerSpec, ok: bool, now: float, *, hard: bool = False) -> None:
        """A worker's outcome. ``hard`` failures (connection refused, failed health probe) open it at once.

        A worker that answers again after a refused connection was restarted at its address (statically listed
        workers have no epoch to say so): the failures of its pairs belonged to the dead process, so their
        breakers start afresh instead of waiting out a cooldown doubled up to ``max_cooldown`` while it was down."""
        w = self.workers.get(spec.key)
        if w is None:
            return
        if ok:
            w.breaker = br.on_success(w.breaker)
            if w.unreachable:  # back at the same address: a new process, so its pairs' failures are history
                w.unreachable = False
                self.pair_breakers.forget(spec.key)
        elif hard:
            w.unreachable = True
            w.breaker = br.force_open(w.breaker, now, self.breaker_cfg)
        else:
            w.breaker = br.on_failure(w.breaker, now, self.breaker_cfg)

    def record_pair(self, pair: Pair, ok: bool, now: float) -> None:
        for gate in self.gates:
            gate.record(pair, ok, now)
