"""The router's integrity monitor: runs the detectors on every response, weighs their findings as evidence, keeps
the per-pair book, vetoes quarantined pairs (it is a ``PairGate`` of the worker pool) and exports
``tandem_integrity_*`` metrics. No I/O: the canary prober, the shadow sampler and the probation mirror do the
requests and report back here.

The proxy calls ``started`` when a request arrives (with the client's identity), ``finished`` with the pair and
the relayed text when its response ends, and ``released`` when it is done with the request. Prompts stay in the
leak index for ``prompt_retention_s`` after their request finished: a garbling decode reuses KV slots of requests
that just ended, so their prompts are exactly what leaks.

A detector finding is not a failure by itself (``evidence``): unless findings from independent clients agree, or
a worker of the pair already failed a canary or shadow comparison (on another pair) within the window, the
finding's request is marked a *suspect* and its pair is confirmed by a shadow re-run of that request on other
pairs (deterministic requests) or a canary burst through the pair; a mismatch there promotes the pending
findings to failures.
"""

from __future__ import annotations

import logging
import math
import time
from collections import deque
from collections.abc import Callable, Collection, Mapping
from dataclasses import dataclass, field
from typing import Protocol

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram

from tandem_router.integrity.detectors import (
    Detection,
    PromptLeakIndex,
    find_bad_text,
    find_repetition_loop,
)
from tandem_router.integrity.divergence import MIN_AGREED_TOKENS, NEAR_TIE_NATS, Kind
from tandem_router.integrity.evidence import DetectorEvidence
from tandem_router.integrity.quarantine import (
    FailureOutcome,
    IntegrityBook,
    QuarantinePolicy,
    QuarantineView,
    Transition,
)

log = logging.getLogger("tandem.router.integrity")

PairKey = tuple[str, str]


class _PairLike(Protocol):
    """What the monitor needs of a pool pair (structural, so this module imports no pool/HTTP code)."""

    @property
    def key(self) -> PairKey: ...


@dataclass(frozen=True)
class IntegrityConfig:
    enabled: bool = True
    leak_ngram: int = 8
    prompt_retention_s: float = 30.0
    max_indexed_prompts: int = 4096
    loop_max_period: int = 16
    loop_min_repeats: int = 4
    loop_min_span_words: int = 24
    independent_clients: int = 2  # clients whose findings quarantine without a confirmation
    confirm_interval_s: float = 1.0  # at most one confirmation per pair per interval
    suspicion_s: float = 30.0  # after an unconfirmed finding, the pair's deterministic answers are all compared
    near_tie_nats: float = NEAR_TIE_NATS  # a flipped token within this margin is numerics (``divergence``)
    min_agreed_tokens: int = MIN_AGREED_TOKENS  # a numerical divergence proves a pair on probation clean after this
    policy: QuarantinePolicy = field(default_factory=QuarantinePolicy)


class IntegrityMetrics:
    def __init__(self, registry: CollectorRegistry) -> None:
        self.registry = registry
        self.detections = Counter(
            "tandem_integrity_detections",
            "Garbled responses found by the live detectors, by finding.",
            ["finding"],
            registry=registry,
        )
        self.checked = Counter(
            "tandem_integrity_checked_responses", "Responses run through the live detectors.", registry=registry
        )
        self.check_seconds = Histogram(
            "tandem_integrity_check_seconds",
            "Time spent in the live detectors per response.",
            buckets=(1e-5, 5e-5, 1e-4, 5e-4, 1e-3, 5e-3, 1e-2, 5e-2),
            registry=registry,
        )
        self.canaries = Counter(
            "tandem_integrity_canaries", "Known-answer canary probes, by result.", ["result"], registry=registry
        )
        self.shadows = Counter(
            "tandem_integrity_shadows",
            "Sampled shadow comparisons of a live request on a second pair, by result.",
            ["result"],
            registry=registry,
        )
        self.quarantines = Counter("tandem_integrity_quarantines", "Pairs put into quarantine.", registry=registry)
        self.releases = Counter(
            "tandem_integrity_releases", "Pairs released from quarantine after clean probes.", registry=registry
        )
        self.quarantined = Gauge(
            "tandem_integrity_quarantined_pairs", "Pairs in quarantine now (probation included).", registry=registry
        )
        self.probation = Gauge("tandem_integrity_probation_pairs", "Pairs on probation now.", registry=registry)
        self.comparisons = Counter(
            "tandem_integrity_probation_comparisons",
            "Answers of pairs on probation compared with trusted answers, by result.",
            ["result"],
            registry=registry,
        )
        self.unconfirmed = Counter(
            "tandem_integrity_unconfirmed_findings",
            "Detector findings held until a canary or shadow confirms them (one client, or the share cap).",
            registry=registry,
        )
        self.confirmations = Counter(
            "tandem_integrity_confirmations", "Confirmations of detector findings started.", registry=registry
        )


class IntegrityMonitor:
    def __init__(
        self,
        cfg: IntegrityConfig,
        registry: CollectorRegistry,
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        self.cfg = cfg
        self.clock = clock
        self.book = IntegrityBook(cfg.policy)
        self.evidence = DetectorEvidence(cfg.policy.window_s, cfg.independent_clients)
        self.index = PromptLeakIndex(cfg.leak_ngram, cfg.max_indexed_prompts)
        self.metrics = IntegrityMetrics(registry)
        self._expiring: deque[tuple[float, str]] = deque()
        self._clients: dict[str, str] = {}  # request id -> client, while its prompt is indexed
        self._suspects: dict[str, PairKey] = {}  # request id -> pair, findings waiting for a confirmation
        self._confirmed_at: dict[PairKey, float] = {}
        self._suspicious_until: dict[PairKey, float] = {}
        self._failed_at: dict[PairKey, float] = {}  # pair -> when a request through it last failed
        self._peer_quarantined_until: dict[PairKey, float] = {}  # pairs another router quarantined (``suspect``)
        self._adopted: set[tuple[PairKey, str]] = set()  # (pair, peer's entry) adopted, while the peer reports it
        self._known_pairs: list[PairKey] = []
        self._epochs: dict[str, int] = {}

    # -- PairGate ---------------------------------------------------------------------------------------------
    def allows(self, pair: _PairLike, now: float) -> bool:
        if not self.cfg.enabled:
            return True
        return not self.book.is_quarantined(pair.key)

    def record(self, pair: _PairLike, ok: bool, now: float) -> None:
        """Transport outcomes are the breakers' business and integrity only scores content, but a pair whose request
        failed is probed first by the next canary round (a broken transfer path may also garble)."""
        if not ok:
            self._failed_at[pair.key] = self.clock()

    # -- live traffic -----------------------------------------------------------------------------------------
    def started(self, request_id: str, prompt: str, client: str = "") -> None:
        if self.cfg.enabled:
            self._expire(self.clock())
            self.index.add(request_id, prompt)
            self._clients[request_id] = client or f"request:{request_id}"

    def released(self, request_id: str) -> None:
        if self.cfg.enabled:
            self._expiring.append((self.clock() + self.cfg.prompt_retention_s, request_id))

    def finished(self, pair: PairKey, request_id: str, prompt: str, outputs: list[str]) -> list[Detection]:
        """Run the detectors on a finished response's texts and weigh what they found. Returns the findings."""
        if not self.cfg.enabled:
            return []
        started = time.perf_counter()
        found: list[Detection] = []
        for text in outputs:
            detection = (
                self.index.check(request_id, prompt, text)
                or find_repetition_loop(
                    text, self.cfg.loop_max_period, self.cfg.loop_min_repeats, self.cfg.loop_min_span_words, prompt
                )
                or find_bad_text(text, prompt)
            )
            if detection is not None:
                found.append(detection)
        self.metrics.checked.inc()
        self.metrics.check_seconds.observe(time.perf_counter() - started)
        for detection in found:
            self.metrics.detections.labels(detection.finding.value).inc()
            log.warning(
                "garbled output",
                extra={
                    "request_id": request_id,
                    "prefill": pair[0],
                    "decode": pair[1],
                    "finding": detection.finding.value,
                    "detail": detection.detail[:200],
                },
            )
            self._weigh(pair, request_id, detection)
        return found

    def _weigh(self, pair: PairKey, request_id: str, detection: Detection) -> None:
        """A finding counts at once only when independent clients back it (and within the share cap); else its
        request becomes a suspect whose pair gets confirmed."""
        now = self.clock()
        clients = {self._clients.get(request_id, f"request:{request_id}")}
        clients |= {self._clients.get(src, f"request:{src}") for src in detection.sources}
        self.evidence.add(pair, clients, f"{detection.finding.value}: {detection.detail[:160]}", now)
        for scope in (frozenset({pair}), *(self._pairs_of(w) | {pair} for w in pair)):
            if self.evidence.independent_among(scope, now):
                if self._promote(scope, now, detector_only=True):
                    return
                break  # held by the share cap: confirm first
        else:
            # A worker of this pair was caught by a canary or shadow on another pair: that corroborates the
            # finding (the spread rule then takes the worker's pairs out, within the share cap).
            confirmed = any(self.book.worker_confirmed_failing(w, now) for w in pair)
            if confirmed and self._promote(frozenset({pair}), now, detector_only=True):
                return
        self.metrics.unconfirmed.inc()
        self._suspicious_until[pair] = now + self.cfg.suspicion_s
        if len(self._suspects) >= self.cfg.max_indexed_prompts:
            self._suspects.pop(next(iter(self._suspects)))
        self._suspects[request_id] = pair

    def take_suspect(self, request_id: str) -> PairKey | None:
        """The pair to confirm for this finished request, if its findings wait for a confirmation and the pair
        was not confirmed within ``confirm_interval_s`` (a client cannot make the router probe without bound)."""
        pair = self._suspects.pop(request_id, None)
        if pair is None or self.book.is_quarantined(pair):
            return None
        now = self.clock()
        if now - self._confirmed_at.get(pair, -math.inf) < self.cfg.confirm_interval_s:
            return None
        self._confirmed_at[pair] = now
        self.metrics.confirmations.inc()
        return pair

    def under_suspicion(self, pair: PairKey) -> bool:
        """A serving pair with an unconfirmed finding within ``suspicion_s``, or that shares a worker with a pair
        that failed a canary or shadow comparison within the window: its deterministic answers are all compared
        (most garbled text is not detectable as such, and the suspect request itself may not be comparable)."""
        now = self.clock()
        if self.book.is_quarantined(pair):
            return False
        if self._suspicious_until.get(pair, -math.inf) > now:
            return True
        return any(self.book.worker_confirmed_failing(w, now) for w in pair)

    def probe_first(self, pair: PairKey) -> bool:
        """Canary rounds probe this pair before their rotation: it is under suspicion, or a request through it
        failed within ``suspicion_s``."""
        recent = self.clock() - self._failed_at.get(pair, -math.inf) < self.cfg.suspicion_s
        return recent or self.under_suspicion(pair)

    def suspect(self, pair: PairKey) -> None:
        """Another router quarantined ``pair``: for ``suspicion_s`` its deterministic answers here are re-run on
        other pairs and compared, and the first that fails (this router's own evidence agreeing with the other's)
        quarantines it with the other router's pairs that share a worker with it (``record_failure``). Nothing is
        quarantined on the other's word alone."""
        if not self.book.is_quarantined(pair):
            until = self.clock() + self.cfg.suspicion_s
            self._suspicious_until[pair] = self._peer_quarantined_until[pair] = until

    def adopt(self, shared: Mapping[PairKey, Collection[str]]) -> list[PairKey]:
        """The shared quarantines of the cluster's other routers (pair -> the peers' entries for it, each naming the
        router and its reason): each entry not seen before quarantines its pair here at once (``book.adopt``). They
        rest on comparisons the other router made (canary, shadow or probation mismatches), which no client can
        make look like corruption; detector findings alone are never shared. An entry is adopted once while its
        router reports it, so a pair released here on probation is not taken out again by the same report; a new
        quarantine there (after a failed probation, say) is a new entry. Pairs this router cannot form wait.
        Returns the pairs quarantined."""
        now, known = self.clock(), set(self._known_pairs)
        current = {(pair, entry) for pair, entries in shared.items() for entry in entries}
        self._adopted &= current
        newly = []
        for pair, entry in sorted(current - self._adopted):
            if pair not in known:
                continue
            self._adopted.add((pair, entry))
            reason = f"quarantined by another router: {entry}"
            for p in self.book.adopt(pair, reason, now, self._known_pairs):
                newly.append(p)
                self.metrics.quarantines.inc()
                log.error("pair quarantined", extra={"prefill": p[0], "decode": p[1], "reason": reason})
        if newly:
            self._update_gauge()
        return newly

    def _pairs_of(self, worker: str) -> frozenset[PairKey]:
        return frozenset(p for p in self._known_pairs if worker in p)

    def _promote(self, pairs: frozenset[PairKey], now: float, *, detector_only: bool) -> bool:
        """Turn the pending findings on ``pairs`` into failures. False when the share cap held them back."""
        for pair, finding in sorted(self.evidence.pending(pairs, now), key=lambda pf: pf[1].at):
            known = self._known_pairs
            outcome = self.book.record_failure(pair, finding.reason, now, known, detector_only=detector_only)
            if outcome.held_by_share_cap:
                return False
            self.evidence.discard(pair, finding)
            self._note(outcome, finding.reason)
        return True

    # -- corroborated failures, canaries, probation -----------------------------------------------------------
    def failure(self, pair: PairKey, reason: str) -> None:
        """A canary or shadow mismatch on ``pair``: a failure, and the confirmation of its pending findings."""
        now = self.clock()
        self._peer_quarantined_until = {p: t for p, t in self._peer_quarantined_until.items() if t > now}
        outcome = self.book.record_failure(
            pair, reason, now, self._known_pairs, corroborated=self._peer_quarantined_until.keys()
        )
        self._note(outcome, reason)
        self._promote(frozenset({pair}), now, detector_only=False)
        self._update_gauge()

    def _note(self, outcome: FailureOutcome, reason: str) -> None:
        for p in outcome.newly:
            self.metrics.quarantines.inc()
            log.error("pair quarantined", extra={"prefill": p[0], "decode": p[1], "reason": reason})

    def canary_result(self, pair: PairKey, clean: bool, reason: str = "", numerical_at: int | None = None) -> None:
        """A canary answer of ``pair``: ``clean`` unless DIFFERENT from the reference; ``numerical_at``: the token
        where a clean answer parted from the reference by numerics (never a failure)."""
        label = "fail" if not clean else "pass" if numerical_at is None else "numerical"
        self.metrics.canaries.labels(label).inc()
        if self.book.in_probation(pair):
            self.comparison(pair, clean, reason, numerical_at)
        elif not clean and not self.book.is_quarantined(pair):
            self.failure(pair, reason)

    def comparison(self, pair: PairKey, clean: bool, reason: str = "", numerical_at: int | None = None) -> None:
        """A pair on probation answered like a trusted pair (``clean``) or not. A clean answer that parted from the
        trusted one by numerics before ``min_agreed_tokens`` tokens proves nothing either way (``probation.py``)."""
        if not self.book.in_probation(pair):
            return
        if clean and numerical_at is not None and numerical_at < self.cfg.min_agreed_tokens:
            self.metrics.comparisons.labels("numerical_early").inc()
            return
        label = "mismatch" if not clean else "match" if numerical_at is None else "numerical"
        self.metrics.comparisons.labels(label).inc()
        transition = self.book.record_comparison(pair, clean, self.clock(), reason)
        if transition is Transition.RELEASED:
            self.metrics.releases.inc()
            log.info("pair released from quarantine", extra={"prefill": pair[0], "decode": pair[1]})
        elif transition is Transition.QUARANTINED:
            self.metrics.quarantines.inc()
            log.error("pair failed probation", extra={"prefill": pair[0], "decode": pair[1], "reason": reason})
        self._update_gauge()

    def inconclusive(self, pair: PairKey) -> None:
        """A pair on probation disagreed with a trusted pair, and no third pair settled it: not proven clean."""
        if self.book.in_probation(pair):
            self.metrics.comparisons.labels("inconclusive").inc()
            self.book.record_inconclusive(pair, self.clock())

    def shadow_result(self, kind: Kind) -> None:
        """A shadow comparison's verdict: ``match`` (same text), ``numerical`` (agreement up to numerics) or
        ``mismatch``."""
        label = {Kind.SAME: "match", Kind.NUMERICAL: "numerical", Kind.DIFFERENT: "mismatch"}[kind]
        self.metrics.shadows.labels(label).inc()

    def start_probations(self) -> list[PairKey]:
        started = self.book.start_probations(self.clock())
        for pair in started:
            log.info("pair on probation", extra={"prefill": pair[0], "decode": pair[1]})
        self._update_gauge()
        return started

    def probation_pairs(self) -> list[PairKey]:
        return self.book.probation_pairs()

    def idle_probations(self, idle_s: float) -> list[PairKey]:
        return self.book.idle_probations(self.clock(), idle_s)

    def set_pairs(self, pairs: list[PairKey], epochs: Mapping[str, int] | None = None) -> None:
        """The pairs the pool can form now, and each worker's epoch: pairs of gone or recreated workers are
        forgotten (a new incarnation starts clean)."""
        epochs = epochs or {}
        renewed = {w for w, e in epochs.items() if self._epochs.get(w, e) != e}
        for gone in set(self.book_pairs()) - set(pairs) | {p for p in self.book_pairs() if renewed & set(p)}:
            self.book.forget(gone)
            self.evidence.forget(gone)
            self._suspicious_until.pop(gone, None)
            self._failed_at.pop(gone, None)
        self._epochs.update(epochs)
        self._known_pairs = list(pairs)
        self._update_gauge()

    def book_pairs(self) -> list[PairKey]:
        return [(q.prefill, q.decode) for q in self.book.quarantined()] + self._known_pairs

    def quarantined(self) -> list[QuarantineView]:
        return self.book.quarantined()

    def quarantined_keys(self) -> frozenset[PairKey]:
        return frozenset((q.prefill, q.decode) for q in self.book.quarantined())

    def quarantined_workers(self) -> set[str]:
        return self.book.quarantined_workers(self._known_pairs)

    def quarantined_share(self) -> float:
        return self.book.quarantined_share(self._known_pairs)

    def repeat_offenders(self) -> list[tuple[str, int, int, str]]:
        """(worker, epoch, quarantines, last reason) of workers that keep failing across quarantine cycles."""
        found = self.book.repeat_offenders(self._known_pairs)
        return [(w, self._epochs.get(w, 0), n, why) for w, (n, why) in sorted(found.items())]

    def _update_gauge(self) -> None:
        self.metrics.quarantined.set(len(self.book.quarantined()))
        self.metrics.probation.set(len(self.book.probation_pairs()))

    def _expire(self, now: float) -> None:
        while self._expiring and self._expiring[0][0] <= now:
            request_id = self._expiring.popleft()[1]
            self.index.discard(request_id)
            self._clients.pop(request_id, None)
