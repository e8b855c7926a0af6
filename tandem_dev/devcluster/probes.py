"""A container's startup, readiness and liveness probes, run as the kubelet runs them (``pkg/kubelet/prober``).

``Probe.parse`` reads a probe from the container spec with the API's defaults (period 10 s, timeout 1 s, success
threshold 1, failure threshold 3, no initial delay) and named ports resolved against the container's ``ports``.
``ProbeTracker`` is the kubelet's result bookkeeping (``prober/worker.go``): a result flips after
``successThreshold`` successes or ``failureThreshold`` failures in a row. ``ContainerProbes`` schedules the three
and says what follows (ready changed, or kill the container). ``check`` runs one probe: ``httpGet`` from the
node's side to the pod IP (success is a status in [200, 400), as ``probe/http``), ``tcpSocket`` a connect,
``exec`` the command inside the pod's namespaces with the container's env, success = exit 0 within the timeout.
``kill_grace_s`` and ``prestop_command`` say how the kubelet kills a container whose probe failed
(``kuberuntime_container.go``: ``killContainer``): the container's ``preStop`` exec hook first, then SIGTERM,
SIGKILL once the grace period is over, the probe's own ``terminationGracePeriodSeconds`` (liveness and startup,
Kubernetes >= 1.25) taking the place of the pod's.
"""

from __future__ import annotations

import asyncio
import contextlib
import os
from collections.abc import Callable, Collection, Mapping, Sequence
from dataclasses import dataclass, field
from enum import Enum
from typing import Any

import aiohttp


class ProbeSpecError(ValueError):
    """The probe names something the container does not have (an unknown named port)."""


def _port(value: Any, container: Mapping[str, Any]) -> int:
    if isinstance(value, int) or str(value).isdigit():
        return int(value)
    for port in container.get("ports") or ():
        if port.get("name") == value:
            return int(port["containerPort"])
    raise ProbeSpecError(f"probe port {value!r} is not a port of container {container.get('name')!r}")


@dataclass(frozen=True)
class ProbeTiming:
    initial_delay_s: float = 0.0
    period_s: float = 10.0
    timeout_s: float = 1.0
    success_threshold: int = 1
    failure_threshold: int = 3

    @classmethod
    def parse(cls, spec: Mapping[str, Any]) -> ProbeTiming:
        return cls(
            initial_delay_s=float(spec.get("initialDelaySeconds", 0)),
            period_s=float(spec.get("periodSeconds", 10)),
            timeout_s=float(spec.get("timeoutSeconds", 1)),
            success_threshold=int(spec.get("successThreshold", 1)),
            failure_threshold=int(spec.get("failureThreshold", 3)),
        )


@dataclass(frozen=True)
class Probe:
    kind: str  # "httpGet" | "tcpSocket" | "exec"
    port: int = 0
    path: str = "/"
    scheme: str = "HTTP"
    host: str | None = None
    headers: tuple[tuple[str, str], ...] = ()
    command: tuple[str, ...] = ()
    timing: ProbeTiming = field(default_factory=ProbeTiming)

    @classmethod
    def parse(cls, container: Mapping[str, Any], which: str = "readinessProbe") -> Probe | None:
        spec = container.get(which)
        if not spec:
            return None
        timing = ProbeTiming.parse(spec)
        if "httpGet" in spec:
            http = spec["httpGet"]
            headers = tuple((h["name"], h["value"]) for h in http.get("httpHeaders") or ())
            return cls(
                "httpGet",
                port=_port(http["port"], container),
                path=http.get("path") or "/",
                scheme=http.get("scheme", "HTTP"),
                host=http.get("host"),
                headers=headers,
                timing=timing,
            )
        if "tcpSocket" in spec:
            tcp = spec["tcpSocket"]
            return cls("tcpSocket", port=_port(tcp["port"], container), host=tcp.get("host"), timing=timing)
        if "exec" in spec:
            return cls("exec", command=tuple(spec["exec"].get("command") or ()), timing=timing)
        raise ProbeSpecError(f"{which} of container {container.get('name')!r} has no handler: {sorted(spec)}")


@dataclass
class ProbeTracker:
    """Consecutive results -> ready/healthy (kubelet ``prober/worker.go``; readiness and startup start failed,
    liveness succeeded)."""

    probe: Probe
    ready: bool = False
    successes: int = 0
    failures: int = 0

    def record(self, ok: bool) -> bool:
        """Count one result; True when ``ready`` changed."""
        if ok:
            self.successes, self.failures = self.successes + 1, 0
            turned = not self.ready and self.successes >= self.probe.timing.success_threshold
        else:
            self.failures, self.successes = self.failures + 1, 0
            turned = self.ready and self.failures >= self.probe.timing.failure_threshold
        if turned:
            self.ready = not self.ready
        return turned


STARTUP, READINESS, LIVENESS = "startupProbe", "readinessProbe", "livenessProbe"


class Verdict(Enum):
    NOTHING = "nothing"
    READY_CHANGED = "ready changed"
    KILL = "kill"  # startup or liveness probe failed failureThreshold times: the kubelet kills the container


@dataclass
class ContainerProbes:
    """The three probes of one container run, as the kubelet's probe workers run them (``prober/worker.go``):
    readiness and liveness wait until the startup probe has succeeded (at once without one); readiness starts
    failed, liveness succeeded; each probe first runs ``initialDelaySeconds`` after the container started.
    ``ready`` is the container's ready flag (no readinessProbe: ready once started)."""

    trackers: dict[str, ProbeTracker]
    next_at: dict[str, float]
    started: bool
    ready: bool

    @classmethod
    def for_container(cls, container: Mapping[str, Any], started_at: float) -> ContainerProbes:
        probes = {kind: probe for kind in (STARTUP, READINESS, LIVENESS) if (probe := Probe.parse(container, kind))}
        trackers = {kind: ProbeTracker(probe, ready=kind == LIVENESS) for kind, probe in probes.items()}
        next_at = {kind: started_at + probe.timing.initial_delay_s for kind, probe in probes.items()}
        started = STARTUP not in probes
        return cls(trackers, next_at, started, started and READINESS not in probes)

    def due(self, now: float, running: Collection[str] = ()) -> list[str]:
        """The probes to run now (each then waits one period; one still ``running`` waits for its result, and runs
        again at once if that came after its period, as the kubelet's probe worker and its ticker do)."""
        kinds = [
            kind
            for kind in self.trackers
            if (kind == STARTUP) != self.started and now >= self.next_at[kind] and kind not in running
        ]
        for kind in kinds:
            self.next_at[kind] = now + self.trackers[kind].probe.timing.period_s
        return kinds

    def next_due(self) -> float:
        waiting = [at for kind, at in self.next_at.items() if (kind == STARTUP) != self.started]
        return min(waiting, default=float("inf"))

    def record(self, kind: str, ok: bool) -> Verdict:
        tracker = self.trackers[kind]
        changed = tracker.record(ok)
        if kind == READINESS:
            if changed:
                self.ready = tracker.ready
                return Verdict.READY_CHANGED
            return Verdict.NOTHING
        if kind == STARTUP and tracker.ready:
            self.started = True
            if READINESS not in self.trackers:
                self.ready = True
                return Verdict.READY_CHANGED
            return Verdict.NOTHING
        if not tracker.ready and tracker.failures >= tracker.probe.timing.failure_threshold:
            return Verdict.KILL
        return Verdict.NOTHING


MIN_KILL_GRACE_S = 2.0  # the kubelet's minimumGracePeriodInSeconds: SIGTERM always gets this long


def kill_grace_s(pod_spec: Mapping[str, Any], container: Mapping[str, Any], probe_kind: str | None) -> float:
    """The grace period of a kill: the failed probe's ``terminationGracePeriodSeconds`` (liveness, startup), else
    the pod's (default 30 s)."""
    probe = (container.get(probe_kind) or {}) if probe_kind in (STARTUP, LIVENESS) else {}
    grace = probe.get("terminationGracePeriodSeconds", pod_spec.get("terminationGracePeriodSeconds", 30))
    return float(grace)


def prestop_command(container: Mapping[str, Any]) -> tuple[str, ...]:
    """The container's ``preStop`` exec command (empty without one; httpGet and sleep hooks are not run)."""
    hook = ((container.get("lifecycle") or {}).get("preStop") or {}).get("exec") or {}
    return tuple(hook.get("command") or ())


@dataclass(frozen=True)
class ProbeTarget:
    """Where a probe runs: the pod IP, and how to run a command in the pod's namespace with its env."""

    ip: str
    in_pod: Callable[[Sequence[str]], list[str]]
    env: Mapping[str, str] = field(default_factory=dict)


async def check(
    probe: Probe, target: ProbeTarget, session: aiohttp.ClientSession, timeout_s: float | None = None
) -> bool:
    """One probe (or exec hook); False on any failure or after its timeout (``timeout_s``, else the probe's)."""
    try:
        async with asyncio.timeout(probe.timing.timeout_s if timeout_s is None else timeout_s):
            if probe.kind == "httpGet":
                scheme = probe.scheme.lower()
                url = f"{scheme}://{probe.host or target.ip}:{probe.port}{probe.path}"
                async with session.get(url, headers=dict(probe.headers), allow_redirects=False, ssl=False) as resp:
                    return 200 <= resp.status < 400
            if probe.kind == "tcpSocket":
                _, writer = await asyncio.open_connection(probe.host or target.ip, probe.port)
                writer.close()
                with contextlib.suppress(OSError):
                    await writer.wait_closed()
                return True
            return await _exec(probe, target)
    except (TimeoutError, OSError, aiohttp.ClientError):
        return False


async def _exec(probe: Probe, target: ProbeTarget) -> bool:
    proc = await asyncio.create_subprocess_exec(
        *target.in_pod(probe.command),
        env={**os.environ, **target.env},
        stdin=asyncio.subprocess.DEVNULL,
        stdout=asyncio.subprocess.DEVNULL,
        stderr=asyncio.subprocess.DEVNULL,
        start_new_session=True,
    )
    try:
        return await proc.wait() == 0
    finally:
        if proc.returncode is None:
            with contextlib.suppress(ProcessLookupError):
                os.killpg(proc.pid, 9)
            await proc.wait()
