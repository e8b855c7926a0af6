"""The cluster's capacity in requests at once, learned from the decodes' own gauges (SGLang's
``num_running_reqs``, ``num_queue_reqs``, ``token_usage``, scraped by the health checker), not configured.

A decode that queues requests (``queued > 0``) or has its KV cache nearly full (``kv_usage >= kv_saturation``)
runs all it can: each such sample below its capacity moves the capacity down towards what it runs then (a moving
average: one sample may fall between two requests, a slot just freed and its successor not in it yet). A sample
above the capacity, saturated or not, raises it at once: the decode ran that many at once. ``sample`` (the
adapter's entry) also drops the scrapes of a decode whose running and queued requests stay below its capacity,
unless requests wait on a full KV cache (a queue there is a request on its way into a free slot; a full cache with
nothing waiting holds nothing of ours). Before both, a busy machine learned 9-13 for 2 decodes of
8 slots: flow control held the decodes below their capacity, so their transient queues lowered it further, and a
lone tenant was held below what the cluster runs. (Running as the simulator counts it: from the KV reservation,
the PD transfer included; SGLang's decode keeps its transfer queue apart, so there the learned capacity is lower
by what is in transfer, and the headroom of ``fair`` covers part of it.)

The cluster's capacity is the sum over the decodes that may take traffic; while one of them has never been seen
saturated it is unknown (None), and flow control admits everything, as without it (a new decode is learned at its
first saturation). Workers must export their gauges (SGLang ``--enable-metrics``; the operator sets it).
"""

from __future__ import annotations

from collections.abc import Iterable
from dataclasses import dataclass, field

from tandem_router.policy.load import WorkerLoad

KV_SATURATION = 0.95
SMOOTHING = 0.3  # weight of the newest saturated sample


@dataclass
class CapacityLearner:
    kv_saturation: float = KV_SATURATION
    estimates: dict[str, float] = field(default_factory=dict)  # decode key -> requests it holds at once
    _seen: dict[str, WorkerLoad] = field(default_factory=dict)  # the last scrape read: each counts once

    def observe(self, decode: str, load: WorkerLoad) -> None:
        if self._seen.get(decode) is load:
            return
        self._seen[decode] = load
        held = load.running
        known = self.estimates.get(decode)
        if known is not None and held > known:
            self.estimates[decode] = held  # it ran that many at once: saturated or not, it holds at least those
        elif load.queued > 0 or load.kv_usage >= self.kv_saturation:
            self.estimates[decode] = max(1.0, held if known is None else known + SMOOTHING * (held - known))

    def sample(self, decode: str, load: WorkerLoad) -> None:
        """A scrape of ``decode``'s gauges (``observe``), unless it holds fewer requests (running + queued) than its
        capacity without requests waiting on a full KV cache: then a queue is a request on its way into a free slot
        (the simulator counts it queued while it takes its KV reservation), and a full KV cache with nothing waiting
        holds no request of ours (measured: a simulated decode left at 99.7 % after its clients went away, running
        and queueing nothing). Taken as saturation, such scrapes lowered the capacity while flow control held the
        decodes below it, which held them lower still: 9-13 learned for 2 decodes of 8 slots."""
        known = self.estimates.get(decode)
        if (
            known is not None
            and load.running + load.queued < known
            and not (load.queued > 0 and load.kv_usage >= self.kv_saturation)
        ):
            return
        self.observe(decode, load)

    def capacity(self, available: Iterable[str]) -> int | None:
        """Requests the ``available`` decodes run at once; None while one of them is unknown."""
        total = 0.0
        for key in available:
            known = self.estimates.get(key)
            if known is None:
                return None
            total += known
        return round(total) or None

    def forget_except(self, present: Iterable[str]) -> None:
        keep = set(present)
        for key in [k for k in self.estimates if k not in keep]:
            del self.estimates[key]
            self._seen.pop(key, None)
