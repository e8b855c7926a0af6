"""The faults a chaos run injects, and how each one's fence and recovery are timed. A setting (the local stack
here, the dev cluster in ``tandem_dev.chaos.devcluster``) exposes its workers and etcd members as a ``Cluster``.

- ``prefill`` / ``decode``: the worker is killed (SIGKILL). Fenced when no router would send it traffic (every
  router reports it unavailable, ``tandem_router_worker_available`` 0, or no longer lists it); recovered when
  every router lists the group's registered URL (the same one, or its new pod's) as available again (the local
  stack's supervisor, or the operator, restarted and re-registered it).
- ``router``: killed and started again at once on the same port (as a kubelet restarts a container). Not fenced
  (clients stop using it by themselves: their connections are refused); recovered when it answers ``/readiness``.
- ``etcd``: one member of three killed, started again ``etcd_down_s`` later. Recovered when it answers
  ``/health``; the run shows whether anything else noticed.
- ``registry``: every etcd member frozen (SIGSTOP, as a hung disk or a partition looks to clients) for
  ``registry_freeze_s``, then thawed: longer than the writers' lease TTL, so etcd expires their leases on thawing.
  Not fenced (nothing should stop serving); recovered when every router routes to every registered group again
  and holds none that the registry removed (the writer put the keys back: ``tandem.leased_writer``).
- ``transfer``: KV sends from one prefill to one decode fail (the simulator's ``/tandem/sim/faults`` with
  ``to_sessions``) for ``transfer_down_s``. Fenced at the routers' last failed attempt on that pair (none if no
  router tried it: the cache-aware policy can leave one pair idle); recovered when, after the link is back, the
  prefill no longer blacklists the decode's Mooncake session.
"""

from __future__ import annotations

import asyncio
import signal
import ssl
import time
from collections.abc import Awaitable, Callable
from dataclasses import dataclass, field
from typing import Protocol

import aiohttp
from prometheus_client.parser import text_string_to_metric_families

from tandem.registry import Role
from tandem_dev.chaos.report import FaultRecord
from tandem_dev.local_stack import LocalStack, etcd_pki_of
from tandem_dev.procs import ManagedProcess

KINDS = ("prefill", "decode", "router", "etcd", "registry", "transfer")
POLL_S = 0.1
# What the routers count, summed over routers and over a router's restarts.
COUNTERS = {
    "tandem_router_resumed_streams_total": "streams resumed",
    "tandem_router_retries_total": "retries on another pair",
    "tandem_router_stream_errors_total": "stream error events",
    "tandem_router_registry_panics_total": "registry removal storms held",
}


@dataclass
class Scrape:
    available: dict[str, float] = field(default_factory=dict)  # worker url -> 1 if its breaker admits traffic
    pair_failures: dict[tuple[str, str], float] = field(default_factory=dict)  # (prefill, decode) -> failures
    counters: dict[str, float] = field(default_factory=dict)
    held: float = 0.0  # workers the registry removed in a storm that the router keeps routing to


def parse(text: str) -> Scrape:
    out = Scrape()
    for family in text_string_to_metric_families(text):
        for sample in family.samples:
            if sample.name == "tandem_router_worker_available":
                out.available[sample.labels["worker"]] = sample.value
            elif sample.name == "tandem_router_pair_failures_total":
                key = (sample.labels["prefill"], sample.labels["decode"])
                out.pair_failures[key] = out.pair_failures.get(key, 0.0) + sample.value
            elif sample.name == "tandem_router_registry_held_workers":
                out.held = sample.value
            elif sample.name in COUNTERS:
                name = COUNTERS[sample.name]
                out.counters[name] = out.counters.get(name, 0.0) + sample.value
    return out


@dataclass
class Router:
    url: str
    proc: ManagedProcess


class Cluster(Protocol):
    """What a setting lets the faults reach: its worker groups, its etcd members."""

    @property
    def etcds(self) -> list[ManagedProcess]: ...

    def groups(self, role: Role) -> list[str]: ...

    async def worker_url(self, group: str) -> str | None:
        """The group's URL as registered now (None while it is not)."""

    def kill_worker(self, group: str) -> None: ...

    def etcd_health(self, member: ManagedProcess) -> tuple[str, ssl.SSLContext | None]:
        """The member's ``/health`` URL and the TLS context it needs."""


@dataclass
class LocalCluster:
    """The local stack as a ``Cluster``: a group's URL never changes, its supervisor restarts it."""

    stack: LocalStack

    @property
    def etcds(self) -> list[ManagedProcess]:
        return self.stack.etcds

    def groups(self, role: Role) -> list[str]:
        return [w.group for w in self.stack.workers if w.role is role]

    async def worker_url(self, group: str) -> str | None:
        return next(w.url for w in self.stack.workers if w.group == group)

    def kill_worker(self, group: str) -> None:
        next(w for w in self.stack.workers if w.group == group).proc.signal(signal.SIGKILL)

    def etcd_health(self, member: ManagedProcess) -> tuple[str, ssl.SSLContext | None]:
        # etcd's /health asks for a client certificate too when the stack secures etcd (its default).
        tls = etcd_pki_of(self.stack.workdir).ssl_context() if self.stack.secure else None
        endpoint = self.stack.etcd_endpoints[self.stack.etcds.index(member)]
        return f"{'https' if tls else 'http'}://{endpoint}/health", tls


Injector = Callable[[str, FaultRecord], Awaitable[None]]


@dataclass
class ChaosTarget:
    """The processes a run may hit, and one pooled session for scraping them."""

    cluster: Cluster
    routers: list[Router]
    http: aiohttp.ClientSession
    etcd_down_s: float = 2.0
    registry_freeze_s: float = 20.0
    transfer_down_s: float = 5.0
    cap_s: float = 60.0
    # Counters as last scraped per router, and what earlier incarnations of each router had counted.
    _last: dict[str, dict[str, float]] = field(default_factory=dict)
    _carried: dict[str, float] = field(default_factory=dict)

    async def scrape(self, router: Router) -> Scrape | None:
        try:
            async with self.http.get(f"{router.url}/metrics", timeout=aiohttp.ClientTimeout(total=2)) as resp:
                scrape = parse(await resp.text())
        except (aiohttp.ClientError, TimeoutError):
            return None  # down (being restarted)
        last = self._last.setdefault(router.url, {})
        for name, value in scrape.counters.items():
            if value < last.get(name, 0.0):  # the router restarted: keep what the old one counted
                self._carried[name] = self._carried.get(name, 0.0) + last[name]
            last[name] = value
        return scrape

    async def scrape_all(self) -> list[Scrape]:
        scrapes = await asyncio.gather(*(self.scrape(r) for r in self.routers))
        return [s for s in scrapes if s is not None]

    def counters(self) -> dict[str, float]:
        """Every router's counters as last scraped, plus what routers counted before they were restarted."""
        total = dict.fromkeys(COUNTERS.values(), 0.0)
        for last in self._last.values():
            for name, value in last.items():
                total[name] += value
        for name, value in self._carried.items():
            total[name] += value
        return total

    def injectors(self) -> dict[str, Injector]:
        """Fault kind -> what injects it and times its fence and recovery (a setting may add kinds)."""
        return {
            "prefill": self.kill_worker,
            "decode": self.kill_worker,
            "router": self._kill_router,
            "etcd": self._kill_etcd,
            "registry": self._freeze_registry,
            "transfer": self._break_link,
        }

    async def inject(self, kind: str, victim: str, t0: float) -> FaultRecord:
        record = FaultRecord(kind, victim, time.monotonic() - t0)
        await self.injectors()[kind](victim, record)
        return record

    def victims(self, kind: str) -> list[str]:
        """Names a fault of ``kind`` may hit (``prefill-0``, ``router-1``, ``etcd-2``, ``prefill-0>decode-1``)."""
        groups = {role: self.cluster.groups(role) for role in Role}
        if kind in ("prefill", "decode"):
            return groups[Role(kind)]
        if kind == "router":
            return [f"router-{i}" for i in range(len(self.routers))]
        if kind == "etcd":
            return [p.name for p in self.cluster.etcds]
        if kind == "registry":
            return ["registry"]
        return [f"{p}>{d}" for p in groups[Role.PREFILL] for d in groups[Role.DECODE]]

    async def victims_now(self, kind: str) -> list[str]:
        """``victims(kind)``, except that a broken KV link joins a prefill and a decode that are serving: the
        routers' cache-aware policy can leave a just recreated worker idle while the prompts' cached prefixes live
        elsewhere, and a link that carries no traffic tests nothing. Serving: its ``sglang:num_requests_total``
        rose within 1 s. Falls back to every pair when none qualifies."""
        pairs = self.victims(kind)
        if kind != "transfer":
            return pairs
        groups = sorted({group for pair in pairs for group in pair.split(">")})
        before = [await self._requests(g) for g in groups]
        await asyncio.sleep(1.0)
        after = [await self._requests(g) for g in groups]
        serving = {g for g, b, a in zip(groups, before, after, strict=True) if a > b}
        return [pair for pair in pairs if set(pair.split(">")) <= serving] or pairs

    async def _requests(self, group: str) -> float:
        url = await self.cluster.worker_url(group)
        if url is None:
            return 0.0
        try:
            async with self.http.get(f"{url}/metrics", timeout=aiohttp.ClientTimeout(total=2)) as resp:
                text = await resp.text()
        except (aiohttp.ClientError, TimeoutError):
            return 0.0
        families = text_string_to_metric_families(text)
        return sum(s.value for f in families for s in f.samples if s.name == "sglang:num_requests_total")

    async def until(self, condition: Callable[[], Awaitable[bool]], since: float) -> float | None:
        """Seconds from ``since`` until ``condition`` holds; None if not within ``cap_s``."""
        while time.monotonic() - since < self.cap_s:
            if await condition():
                return time.monotonic() - since
            await asyncio.sleep(POLL_S)
        return None

    async def kill_worker(self, victim: str, record: FaultRecord) -> None:
        url = await self.cluster.worker_url(victim)
        if url is None:
            raise RuntimeError(f"{victim} is not registered: nothing to kill")
        killed = time.monotonic()
        self.cluster.kill_worker(victim)

        async def fenced() -> bool:
            scrapes = await self.scrape_all()
            return len(scrapes) == len(self.routers) and all(s.available.get(url, 0) == 0 for s in scrapes)

        async def back() -> bool:
            now = await self.cluster.worker_url(victim)
            scrapes = await self.scrape_all()
            return (
                now is not None
                and len(scrapes) == len(self.routers)
                and all(s.available.get(now) == 1 for s in scrapes)
            )

        record.note = "fenced: every router has it unavailable or unlisted; recovered: restarted, listed, available"
        record.fenced = await self.until(fenced, killed)
        if record.fenced is None:
            record.note = f"never fenced within {self.cap_s:g} s"
            return
        record.recovered = await self.until(back, killed)

    async def _kill_router(self, victim: str, record: FaultRecord) -> None:
        router = self.routers[int(victim.rsplit("-", 1)[1])]
        killed = time.monotonic()
        # Killed and started again with no await in between, so the stack's supervisor (same event loop), which
        # stops the whole stack when its router exits, never sees it dead.
        router.proc.signal(signal.SIGKILL)
        assert router.proc.popen is not None
        router.proc.popen.wait(10)
        router.proc.start()

        async def ready() -> bool:
            try:
                async with self.http.get(f"{router.url}/readiness", timeout=aiohttp.ClientTimeout(total=2)) as r:
                    return r.status == 200
            except (aiohttp.ClientError, TimeoutError):
                return False

        record.recovered = await self.until(ready, killed)
        record.note = "restarted at once on its port; recovered: answers /readiness"

    async def _kill_etcd(self, victim: str, record: FaultRecord) -> None:
        member = next(p for p in self.cluster.etcds if p.name == victim)
        killed = time.monotonic()
        member.signal(signal.SIGKILL)
        await asyncio.sleep(self.etcd_down_s)
        await asyncio.to_thread(member.stop)
        member.start()

        url, tls = self.cluster.etcd_health(member)

        async def healthy() -> bool:
            try:
                async with self.http.get(url, timeout=aiohttp.ClientTimeout(total=2), ssl=tls or True) as resp:
                    return resp.status == 200
            except (aiohttp.ClientError, TimeoutError):
                return False

        record.recovered = await self.until(healthy, killed)
        record.note = f"down {self.etcd_down_s:g} s, then restarted; recovered: member answers /health"

    async def _freeze_registry(self, victim: str, record: FaultRecord) -> None:
        frozen = time.monotonic()
        for member in self.cluster.etcds:
            member.signal(signal.SIGSTOP)
        try:
            await asyncio.sleep(self.registry_freeze_s)
        finally:
            for member in self.cluster.etcds:
                member.signal(signal.SIGCONT)

        async def converged() -> bool:
            urls = [await self.cluster.worker_url(group) for role in Role for group in self.cluster.groups(role)]
            scrapes = await self.scrape_all()
            return (
                None not in urls
                and len(scrapes) == len(self.routers)
                and all(s.held == 0 and all(s.available.get(str(u)) == 1 for u in urls) for s in scrapes)
            )

        record.recovered = await self.until(converged, frozen)
        record.note = (
            f"every etcd member frozen {self.registry_freeze_s:g} s; recovered: every router routes to every "
            "registered group and holds none the registry removed"
        )

    async def _break_link(self, victim: str, record: FaultRecord) -> None:
        prefill_url, decode_url = [await self.cluster.worker_url(group) for group in victim.split(">")]
        if prefill_url is None or decode_url is None:
            raise RuntimeError(f"{victim}: a group is not registered")
        async with self.http.get(f"{decode_url}/server_info") as resp:
            session = str((await resp.json())["internal_states"][0]["session_id"])
        pair = (prefill_url, decode_url)

        async def failures() -> float:
            return sum(s.pair_failures.get(pair, 0.0) for s in await self.scrape_all())

        seen, last_failure = await failures(), None
        broke = time.monotonic()
        await self._link_fault(prefill_url, 1.0, session)
        while time.monotonic() - broke < self.transfer_down_s:
            now = await failures()
            if now > seen:
                seen, last_failure = now, time.monotonic()
            await asyncio.sleep(POLL_S)
        await self._link_fault(prefill_url, 0.0, session)
        record.fenced = None if last_failure is None else last_failure - broke

        async def unblacklisted() -> bool:
            async with self.http.get(f"{prefill_url}/server_info") as resp:
                states = (await resp.json())["internal_states"]
            return all(session not in s.get("failed_sessions", []) for s in states)

        recovered = await self.until(unblacklisted, time.monotonic())
        record.recovered = None if recovered is None else time.monotonic() - broke
        record.note = (
            f"sends failing for {self.transfer_down_s:g} s; fenced: the routers' last failed attempt on the pair"
            + ("" if last_failure is not None else " (none failed)")
            + "; recovered: the prefill no longer blacklists the decode"
        )

    async def _link_fault(self, prefill_url: str, prob: float, session: str) -> None:
        fault = {"transfer_failure_prob": prob, "to_sessions": [session]}
        async with self.http.post(f"{prefill_url}/tandem/sim/faults", json=fault) as resp:
            if resp.status != 200:
                raise RuntimeError(f"fault injection refused by {prefill_url}: HTTP {resp.status}")
