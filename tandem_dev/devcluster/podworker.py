"""One simulated pod on its fake node, as a kubelet runs it: a network sandbox, the container's process inside it
(restarted per ``restartPolicy``), its probes (each on its own, as the kubelet's probe workers), the kill of a
container whose liveness or startup probe failed (its ``preStop`` exec hook, then SIGTERM, SIGKILL at the end of
the probe's or the pod's grace period), and the status the kubelet would report. A pod deleted through the API
is stopped without its hook (SIGTERM, SIGKILL after 10 s).

Deciding what to write is pure (``podstatus``, ``probes.ProbeTracker``); this class only runs processes, probes and
status patches.
"""

from __future__ import annotations

import asyncio
import contextlib
import dataclasses
import datetime
import logging
from collections.abc import Awaitable, Callable, Mapping, Sequence
from pathlib import Path
from typing import Any

import aiohttp
from kubernetes_asyncio import client

from tandem_dev.devcluster.podnet import PodNetwork, Sandbox
from tandem_dev.devcluster.podstatus import ContainerView, Terminated, backoff_s, restarts, status_patch
from tandem_dev.devcluster.probes import (
    MIN_KILL_GRACE_S,
    ContainerProbes,
    Probe,
    ProbeTarget,
    Verdict,
    check,
    kill_grace_s,
    prestop_command,
)
from tandem_dev.procs import ManagedProcess

log = logging.getLogger("tandem_dev.devcluster.podworker")
EXIT_POLL_S = 0.1
REPORT_ATTEMPTS, REPORT_RETRY_S = 10, 0.5


def _now() -> str:
    return datetime.datetime.now(datetime.UTC).strftime("%Y-%m-%dT%H:%M:%SZ")


class PodWorker:
    """Runs ``argv`` for pod ``pod`` (its API object, kept current by the pod runner) until ``stop()``."""

    def __init__(
        self,
        pod: dict[str, Any],
        container: Mapping[str, Any],
        ip: str,
        argv: Callable[[], list[str]],
        env: Mapping[str, str],
        log_dir: Path,
        api: client.ApiClient,
        session: aiohttp.ClientSession,
        resolve_command: Callable[[Sequence[str]], Awaitable[list[str]]] | None = None,
    ) -> None:
        self.pod = pod
        meta = pod["metadata"]
        self.key = f"{meta.get('namespace', 'default')}/{meta['name']}"
        self.uid: str = meta["uid"]
        self.container_name = str(container.get("name", ""))
        self.image = str(container.get("image", ""))
        self.container = container
        self.grace_s = float(pod["spec"].get("terminationGracePeriodSeconds", 30))
        self.restart_policy = str(pod["spec"].get("restartPolicy", "Always"))
        self.ip = ip
        self.argv = argv
        self.env = dict(env)
        self.log_dir = log_dir
        self.core = client.CoreV1Api(api)
        self.session = session
        self.resolve_command = resolve_command  # Service names in a hook's URLs -> pod IPs (no DNS here)
        self.sandbox: Sandbox | None = None
        self.process: ManagedProcess | None = None
        self.view = ContainerView(self.container_name, self.image, _now())
        self._task: asyncio.Task[None] | None = None

    async def start(self, network: PodNetwork) -> PodWorker:
        began = asyncio.get_running_loop().time()
        making = asyncio.ensure_future(
            asyncio.to_thread(network.start_sandbox, self.key, self.uid, self.ip, self.log_dir)
        )
        try:
            self.sandbox = await asyncio.shield(making)
        except asyncio.CancelledError:  # the thread goes on: keep what it makes, so stop() removes it
            self.sandbox = await making
            raise
        sandbox_ms = round((asyncio.get_running_loop().time() - began) * 1000, 1)
        log.info("sandbox ready", extra={"pod": self.key, "ip": self.ip, "sandbox_ms": sandbox_ms})
        self._task = asyncio.create_task(self._run(), name=f"pod-{self.key}")
        return self

    def alive(self) -> bool:
        return self._task is not None and not self._task.done()

    async def stop(self) -> None:
        """Stop the container and remove the sandbox (pod deleted, changed, or the runner stops)."""
        if self._task is not None:
            self._task.cancel()
            with contextlib.suppress(asyncio.CancelledError, Exception):  # a failed worker was logged already
                await self._task
        if self.process is not None:
            await asyncio.to_thread(self.process.stop)
        if self.sandbox is not None:
            await asyncio.to_thread(self.sandbox.stop)

    async def _run(self) -> None:
        try:
            while True:
                code = await self._run_container()
                ended = Terminated(code, self.view.started_at, _now())
                log.info("container exited", extra={"pod": self.key, "exit_code": code})
                if not restarts(self.restart_policy, code):
                    self.view = dataclasses.replace(self.view, ready=False, terminated=ended)
                    await self._report()
                    return
                delay = backoff_s(self.view.restart_count)
                self.view = dataclasses.replace(
                    self.view, ready=False, last_terminated=ended, waiting_reason="CrashLoopBackOff"
                )
                await self._report()
                await asyncio.sleep(delay)
                self.view = ContainerView(
                    self.container_name, self.image, _now(), self.view.restart_count + 1, last_terminated=ended
                )
        except Exception:
            log.exception("pod worker failed", extra={"pod": self.key})
            raise

    async def _run_container(self) -> int:
        """Start the process, probe it while it runs (killing it when its startup or liveness probe says so),
        return its exit code."""
        assert self.sandbox is not None
        name = self.key.replace("/", "_")
        self.process = ManagedProcess(
            name=f"pod-{name}",
            argv=self.sandbox.exec_argv(self.argv()),
            log_path=self.log_dir / f"{name}-{self.uid[:8]}.log",
            env=self.env,
        ).start()
        log.info("container started", extra={"pod": self.key, "restarts": self.view.restart_count})
        loop = asyncio.get_running_loop()
        probes = ContainerProbes.for_container(self.container, loop.time())
        self.view = dataclasses.replace(self.view, ready=probes.ready)
        await self._report()
        target = ProbeTarget(self.ip, self.sandbox.exec_argv, self.env)
        running: dict[str, asyncio.Task[bool]] = {}  # one probe of each kind at a time, each on its own
        try:
            while (code := self.process.returncode()) is None:
                for kind in probes.due(loop.time(), running):
                    running[kind] = asyncio.create_task(check(probes.trackers[kind].probe, target, self.session))
                for kind in [kind for kind, task in running.items() if task.done()]:
                    ok = running.pop(kind).result()
                    if self.process.returncode() is not None:
                        break
                    verdict = probes.record(kind, ok)
                    if verdict is Verdict.READY_CHANGED:
                        self.view = dataclasses.replace(self.view, ready=probes.ready)
                        log.info("readiness changed", extra={"pod": self.key, "ready": probes.ready})
                        await self._report()
                    elif verdict is Verdict.KILL:
                        await self._kill(kind)
                        break
                await asyncio.sleep(min(EXIT_POLL_S, max(0.0, probes.next_due() - loop.time())))
        finally:
            for task in running.values():
                task.cancel()
        return 128 - code if code < 0 else code  # killed by signal N: exit code 128 + N, as container runtimes

    async def _kill(self, probe_kind: str) -> None:
        """The kubelet's kill after a failed probe: the preStop hook within the grace period (the probe's own
        ``terminationGracePeriodSeconds`` when set), then SIGTERM, SIGKILL when the grace is over (at least 2 s
        after the hook)."""
        assert self.process is not None
        assert self.sandbox is not None
        grace = kill_grace_s(self.pod.get("spec") or {}, self.container, probe_kind)
        log.warning(
            "container failed its probe, killing it", extra={"pod": self.key, "probe": probe_kind, "grace_s": grace}
        )
        loop = asyncio.get_running_loop()
        began = loop.time()
        if command := prestop_command(self.container):
            argv = await self.resolve_command(command) if self.resolve_command is not None else list(command)
            hook = Probe("exec", command=tuple(argv))
            await check(hook, ProbeTarget(self.ip, self.sandbox.exec_argv, self.env), self.session, timeout_s=grace)
            log.info("preStop hook done", extra={"pod": self.key, "hook_s": round(loop.time() - began, 2)})
        remaining = max(grace - (loop.time() - began), MIN_KILL_GRACE_S)
        await asyncio.to_thread(self.process.stop, remaining)
        log.info("container killed", extra={"pod": self.key, "kill_s": round(loop.time() - began, 2)})

    async def resync(self) -> None:
        """Report this container's status again, as a kubelet's status manager does when the API server's copy
        differs from its own (its periodic sync; e.g. once a node whose pods the node controller marked NotReady
        reaches the API server again)."""
        await self._report()

    async def _report(self) -> None:
        """Patch the pod's status; retried, as the kubelet's status manager retries (a busy API server times
        out requests). A deleted pod needs no status, nor does one replaced by a pod of the same name (the patch
        names this pod's UID, which the API server refuses to change: 422 on ``metadata.uid``)."""
        meta = self.pod["metadata"]
        for attempt in range(REPORT_ATTEMPTS):
            patch = status_patch(self.pod, self.view, self.restart_policy, _now())
            try:
                await self.core.patch_namespaced_pod_status(meta["name"], meta.get("namespace", "default"), patch)
                return
            except client.ApiException as err:
                if err.status == 404 or (err.status == 422 and "metadata.uid" in str(err.body)):
                    return
                error = f"HTTP {err.status}: {err.reason}"
            except (aiohttp.ClientError, TimeoutError) as err:
                error = repr(err)
            log.warning("pod status patch failed", extra={"pod": self.key, "attempt": attempt + 1, "error": error})
            await asyncio.sleep(REPORT_RETRY_S * (attempt + 1))
        log.error("pod status not reported", extra={"pod": self.key})
