"""The router's integrity monitor: runs the detectors on every response, keeps the per-pair book, vetoes
quarantined pairs (it is a ``PairGate`` of the worker pool) and exports ``tandem_integrity_*`` metrics.

The proxy calls ``started`` when a request arrives, ``finished`` with the pair and the relayed text when its
response ends, and ``released`` when it is done with the request. Prompts stay in the leak index for
``prompt_retention_s`` after their request finished: a garbling decode reuses KV slots of requests that just
ended, so their prompts are exactly what leaks.
"""

from __future__ import annotations

import logging
import time
from collections import deque
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Protocol

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram

from tandem_router.integrity.detectors import (
    Detection,
    PromptLeakIndex,
    find_bad_text,
    find_repetition_loop,
)
from tandem_router.integrity.quarantine import IntegrityBook, QuarantinePolicy, QuarantineView, Transition

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
        self.quarantined = Gauge("tandem_integrity_quarantined_pairs", "Pairs in quarantine now.", registry=registry)


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
        self.index = PromptLeakIndex(cfg.leak_ngram, cfg.max_indexed_prompts)
        self.metrics = IntegrityMetrics(registry)
        self._expiring: deque[tuple[float, str]] = deque()
        self._known_pairs: list[PairKey] = []

    # -- PairGate ---------------------------------------------------------------------------------------------
    def allows(self, pair: _PairLike, now: float) -> bool:
        if not self.cfg.enabled:
            return True
        return not self.book.is_quarantined(pair.key)

    def record(self, pair: _PairLike, ok: bool, now: float) -> None:
        """Transport outcomes are the breakers' business; integrity only scores content."""

    # -- live traffic -----------------------------------------------------------------------------------------
    def started(self, request_id: str, prompt: str) -> None:
        if self.cfg.enabled:
            self._expire(self.clock())
            self.index.add(request_id, prompt)

    def released(self, request_id: str) -> None:
        if self.cfg.enabled:
            self._expiring.append((self.clock() + self.cfg.prompt_retention_s, request_id))

    def finished(self, pair: PairKey, request_id: str, prompt: str, outputs: list[str]) -> list[Detection]:
        """Run the detectors on a finished response's texts; score the pair. Returns what was found."""
        if not self.cfg.enabled:
            return []
        started = time.perf_counter()
        found: list[Detection] = []
        for text in outputs:
            detection = (
                self.index.check(request_id, prompt, text)
                or find_repetition_loop(
                    text, self.cfg.loop_max_period, self.cfg.loop_min_repeats, self.cfg.loop_min_span_words
                )
                or find_bad_text(text)
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
            self.failure(pair, f"{detection.finding.value}: {detection.detail[:160]}")
        return found

    # -- canaries and quarantine ------------------------------------------------------------------------------
    def failure(self, pair: PairKey, reason: str) -> None:
        now = self.clock()
        newly = [pair] if self.book.record_failure(pair, reason, now) is Transition.QUARANTINED else []
        newly += self.book.spread_to_workers(pair, self._known_pairs, reason, now)
        for p in newly:
            self.metrics.quarantines.inc()
            log.error("pair quarantined", extra={"prefill": p[0], "decode": p[1], "reason": reason})
        self._update_gauge()

    def canary_result(self, pair: PairKey, clean: bool, reason: str = "") -> None:
        self.metrics.canaries.labels("pass" if clean else "fail").inc()
        if self.book.is_quarantined(pair):
            if self.book.record_probe(pair, clean, self.clock(), reason) is Transition.RELEASED:
                self.metrics.releases.inc()
                log.info("pair released from quarantine", extra={"prefill": pair[0], "decode": pair[1]})
        elif not clean:
            self.failure(pair, reason)
        self._update_gauge()

    def shadow_result(self, match: bool) -> None:
        self.metrics.shadows.labels("match" if match else "mismatch").inc()

    def probes_due(self) -> list[PairKey]:
        return self.book.probes_due(self.clock())

    def set_pairs(self, pairs: list[PairKey]) -> None:
        """The pairs the pool can form now (for the worker-level view and for forgetting gone workers)."""
        for gone in set(self._known_pairs) - set(pairs):
            self.book.forget(gone)
        self._known_pairs = list(pairs)
        self._update_gauge()

    def quarantined(self) -> list[QuarantineView]:
        return self.book.quarantined()

    def quarantined_keys(self) -> frozenset[PairKey]:
        return frozenset((q.prefill, q.decode) for q in self.book.quarantined())

    def quarantined_workers(self) -> set[str]:
        return self.book.quarantined_workers(self._known_pairs)

    def _update_gauge(self) -> None:
        self.metrics.quarantined.set(len(self.book.quarantined()))

    def _expire(self, now: float) -> None:
        while self._expiring and self._expiring[0][0] <= now:
            self.index.discard(self._expiring.popleft()[1])
