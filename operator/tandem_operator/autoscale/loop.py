"""The autoscaler of one PDCluster (thin adapter): scrape, ``decide``, write the pools' scale, report.

Every ``spec.autoscaling.intervalSeconds`` it reads each router replica's ``/metrics`` and each registered group
leader's ``/metrics`` (the operator's one pooled worker client), reads both PDPools, calls ``decide.decide`` and,
for a role whose desired groups differ, merge-patches ``PDPool/<cluster>-<role>/scale`` (the scale subresource,
like ``kubectl scale``); the reconcile then creates groups, or drains and deletes them. The decision and its reason
go to ``status.autoscaling`` by a merge patch (the reconcile's server-side applies of the status do not own that
field, so they keep it). It runs only in the leader (the runtime that starts it exists only there).
"""

from __future__ import annotations

import asyncio
import logging
import time
from datetime import UTC, datetime
from typing import Any

from tandem.registry import Role
from tandem_operator.act.k8s.apply import object_path
from tandem_operator.act.k8s.kube import Kube
from tandem_operator.act.worker_metrics import WorkerMetrics
from tandem_operator.api.autoscaling import AutoscalingSpec, AutoscalingStatus, RoleDecision
from tandem_operator.api.common import API_VERSION
from tandem_operator.autoscale.decide import Decision, History, Observation, RoleLoad, decide
from tandem_operator.autoscale.signals import (
    Buckets,
    RouterScrape,
    WorkerGauges,
    combine,
    interval_buckets,
    parse_router,
    parse_worker,
    quantile,
)
from tandem_operator.decide.state import ClusterState
from tandem_operator.desired.naming import pool_name, selector_string

log = logging.getLogger("tandem.operator.autoscale")
IDLE_POLL_S = 5.0  # how often a cluster without spec.autoscaling looks whether it was turned on


def _p90_ms(interval: Buckets) -> float:
    """The interval's p90 in ms; 0 when no request was observed (idle is a reading, not a missing one)."""
    p90 = quantile(0.9, interval)
    return 0.0 if p90 is None else p90 * 1000


def _role_load(pool: dict[str, Any] | None, gauges: list[WorkerGauges | None]) -> RoleLoad:
    spec, status = (pool or {}).get("spec") or {}, (pool or {}).get("status") or {}
    groups, ready = int(spec.get("replicas", 0)), int(status.get("readyReplicas", 0))
    if not gauges or any(g is None for g in gauges):
        return RoleLoad(groups, ready)
    read = [g for g in gauges if g is not None]
    return RoleLoad(
        groups,
        ready,
        queue_reqs=sum(g.queue_reqs for g in read),
        token_usage=max(g.token_usage for g in read),
        running_reqs=sum(g.running_reqs for g in read),
        gen_throughput=sum(g.gen_throughput for g in read),
    )


class Autoscaler:
    def __init__(self, state: ClusterState, kube: Kube, workers: WorkerMetrics) -> None:
        self.state, self.kube, self.workers = state, kube, workers
        self.history = History()
        self._routers: dict[str, RouterScrape] = {}  # each router's previous scrape: p90s are over one interval
        self.last: Decision | None = None

    async def run(self) -> None:
        while True:
            spec = self.state.spec.autoscaling
            if spec is None:
                self.history, self._routers = History(), {}
                await asyncio.sleep(IDLE_POLL_S)
                continue
            try:
                await self.tick(spec)
            except asyncio.CancelledError:
                raise
            except Exception:
                log.exception("autoscaling decision failed", extra={"cluster": self._cluster()})
            await asyncio.sleep(spec.interval_seconds)

    async def router_urls(self, spec: AutoscalingSpec) -> list[str]:
        """``routerMetrics``, or the Ready pods ``routerSelector`` selects."""
        if spec.router_metrics:
            return list(spec.router_metrics)
        pods = await self.kube.list("v1", "Pod", self.state.ref.namespace, selector_string(spec.router_selector))
        return [
            f"http://{pod['status']['podIP']}:{spec.router_port}/metrics"
            for pod in pods
            if (pod.get("status") or {}).get("podIP")
            and not pod["metadata"].get("deletionTimestamp")
            and any(c.get("type") == "Ready" and c.get("status") == "True" for c in pod["status"].get("conditions", []))
        ]

    async def routers(self, spec: AutoscalingSpec) -> tuple[float | None, float | None, dict[int, float] | None]:
        """The routers' TTFT and ITL p90 over the interval since the last scrape, each router against its own
        previous scrape (a router seen for the first time only sets its baseline), and the requests waiting in
        their flow-control queues now, by priority; None when some router did not answer (p90s also when none has
        a previous scrape yet)."""
        urls = await self.router_urls(spec)
        texts = await asyncio.gather(*(self.workers.text(url) for url in urls))
        now = {url: parse_router(text) for url, text in zip(urls, texts, strict=True) if text is not None}
        deltas = [
            RouterScrape(interval_buckets(scrape.ttft, before.ttft), interval_buckets(scrape.itl, before.itl))
            for url, scrape in now.items()
            if (before := self._routers.get(url)) is not None
        ]
        self._routers = now
        if len(now) < len(urls):
            return None, None, None
        queued = dict(combine(now.values()).queued)
        if not deltas:
            return None, None, queued
        total = combine(deltas)
        return _p90_ms(total.ttft), _p90_ms(total.itl), queued

    async def observe(self, spec: AutoscalingSpec) -> Observation:
        ttft, itl, queued = await self.routers(spec)
        registered = list(self.state.registered.items())
        leader_texts = await asyncio.gather(*(self.workers.text(f"{e.url}/metrics") for _, e in registered))
        gauges: dict[Role, list[WorkerGauges | None]] = {role: [] for role in Role}
        for (key, _), text in zip(registered, leader_texts, strict=True):
            gauges[key.role].append(parse_worker(text) if text is not None else None)
        pools = {role: await self.kube.get(self._pool_path(role)) for role in Role}
        return Observation(
            ttft,
            itl,
            prefill=_role_load(pools[Role.PREFILL], gauges[Role.PREFILL]),
            decode=_role_load(pools[Role.DECODE], gauges[Role.DECODE]),
            router_queued=queued or {},
        )

    async def tick(self, spec: AutoscalingSpec) -> Decision:
        obs = await self.observe(spec)
        decision = decide(spec, obs, self.history, time.monotonic())
        self.history, self.last = decision.history, decision
        for role, verdict in decision.verdicts.items():
            if verdict.desired != verdict.current:
                await self.kube.merge_patch(self._pool_path(role, "scale"), {"spec": {"replicas": verdict.desired}})
                log.info(
                    "autoscaled",
                    extra={
                        "cluster": self._cluster(),
                        "role": role.value,
                        "from": verdict.current,
                        "to": verdict.desired,
                        "reason": verdict.reason.value,
                        "why": verdict.message,
                    },
                )
        await self._report(obs, decision)
        return decision

    async def _report(self, obs: Observation, decision: Decision) -> None:
        roles = {
            role.value: RoleDecision(
                current_groups=v.current, desired_groups=v.desired, reason=v.reason.value, message=v.message[:1024]
            )
            for role, v in decision.verdicts.items()
        }
        status = AutoscalingStatus(
            last_decision_time=datetime.now(UTC).strftime("%Y-%m-%dT%H:%M:%SZ"),
            ttft_p90_ms=obs.ttft_p90_ms,
            itl_p90_ms=obs.itl_p90_ms,
            **roles,
        )
        ref = self.state.ref
        manifest = {
            "apiVersion": API_VERSION,
            "kind": "PDCluster",
            "metadata": {"name": ref.name, "namespace": ref.namespace},
        }
        await self.kube.merge_patch(object_path(manifest, "status"), {"status": {"autoscaling": status.to_wire()}})

    def _pool_path(self, role: Role, subresource: str | None = None) -> str:
        ref = self.state.ref
        manifest = {
            "apiVersion": API_VERSION,
            "kind": "PDPool",
            "metadata": {"name": pool_name(ref.name, role), "namespace": ref.namespace},
        }
        return object_path(manifest, subresource)

    def _cluster(self) -> str:
        return f"{self.state.ref.namespace}/{self.state.ref.name}"
