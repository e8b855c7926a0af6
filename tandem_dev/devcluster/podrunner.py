"""Run a real process behind each simulated SGLang pod's IP.

kwok marks pods Running and gives them IPs, but nothing runs inside them. The pod runner watches pods and, for
every Running pod that uses the SGLang image (or carries ``tandem.dev/simulate: "true"``), starts ``tandem sim``
with the pod's ``python3 -m sglang.launch_server`` flags and env, unchanged but for the kubelet's ``$(VAR)``
expansion, inside the pod's own network namespace (``podnet``); ``PodWorker`` then plays the kubelet for it
(readinessProbe, Ready condition, exits and restarts). It stops the process and removes the namespace when the
pod is deleted, stops running, or changes. Deciding is pure (``desired_launches``); ``PodRunner`` only diffs that
against what runs.

The dev cluster has no DNS: a flag naming a Service (``--dist-init-addr <svc>.<ns>.svc:5000``, a multi-node
group's leader) is rewritten to the IP of the Running pod the Service selects (``resolve_services``); a pod whose
Service does not resolve yet waits for the next pod event.
"""

from __future__ import annotations

import asyncio
import contextlib
import dataclasses
import logging
import re
import shlex
import sys
from collections.abc import AsyncIterator, Callable, Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import aiohttp
from kubernetes_asyncio import client, watch

from tandem_dev.devcluster.config import DevClusterConfig
from tandem_dev.devcluster.podnet import PodNetwork, PodNetworkError, Sandbox
from tandem_dev.devcluster.podworker import PodWorker
from tandem_dev.devcluster.services import SERVICE_HOST, resolve_urls, selected_pod_ip, url_service_refs
from tandem_dev.procs import ManagedProcess

log = logging.getLogger("tandem_dev.devcluster.podrunner")

SIMULATE_LABEL = "tandem.dev/simulate"
LAUNCH_MODULE = "sglang.launch_server"
# Downward-API fields a pod's env may reference, resolved from the pod object.
_FIELD_PATHS: dict[str, Callable[[Mapping[str, Any]], Any]] = {
    "metadata.name": lambda pod: pod["metadata"].get("name"),
    "metadata.namespace": lambda pod: pod["metadata"].get("namespace"),
    "metadata.uid": lambda pod: pod["metadata"].get("uid"),
    "spec.nodeName": lambda pod: pod["spec"].get("nodeName"),
    "spec.serviceAccountName": lambda pod: pod["spec"].get("serviceAccountName"),
    "status.podIP": lambda pod: pod.get("status", {}).get("podIP"),
    "status.hostIP": lambda pod: pod.get("status", {}).get("hostIP"),
}


class NotAnSGLangCommandError(ValueError):
    """The container does not run ``python3 -m sglang.launch_server``."""


@dataclass(frozen=True)
class SimulateRule:
    """Which pods get a simulated worker: an image containing ``image_substring``, or the opt-in label."""

    image_substring: str = "sglang"
    label: tuple[str, str] = (SIMULATE_LABEL, "true")

    def container(self, pod: Mapping[str, Any]) -> Mapping[str, Any] | None:
        containers: list[Mapping[str, Any]] = pod.get("spec", {}).get("containers", [])
        labels = pod.get("metadata", {}).get("labels") or {}
        for c in containers:
            if self.image_substring and self.image_substring in c.get("image", ""):
                return c
        if containers and labels.get(self.label[0]) == self.label[1]:
            return containers[0]
        return None


@dataclass(frozen=True)
class Launch:
    """What to run for one pod: its SGLang server flags and env, as the kubelet would pass them, and its IP."""

    pod: str  # namespace/name
    uid: str
    host: str
    server_args: tuple[str, ...]
    env: tuple[tuple[str, str], ...] = field(default=())

    @property
    def port(self) -> int:
        return int(_flag_value(self.server_args, "--port") or 30000)


def _flag_value(args: Sequence[str], flag: str) -> str | None:
    for i, arg in enumerate(args):
        if arg == flag and i + 1 < len(args):
            return args[i + 1]
        if arg.startswith(f"{flag}="):
            return arg.split("=", 1)[1]
    return None


def sglang_server_args(command: Sequence[str]) -> tuple[str, ...]:
    """The flags after ``-m sglang.launch_server`` (also inside ``sh -c "..."``), unchanged."""
    words = list(command)
    if LAUNCH_MODULE not in words:
        for word in words:
            if LAUNCH_MODULE in word:  # a shell script string: sh -c "exec python3 -m sglang.launch_server ..."
                words = shlex.split(word)
                break
    if LAUNCH_MODULE not in words:
        raise NotAnSGLangCommandError(f"command does not run python3 -m {LAUNCH_MODULE}: {shlex.join(command)}")
    return tuple(words[words.index(LAUNCH_MODULE) + 1 :])


VAR_REFERENCE = re.compile(r"\$\$|\$\(([^)]*)\)")


def expand(text: str, env: Mapping[str, str]) -> str:
    """Kubernetes' ``$(VAR)`` expansion of command, args and env values (``third_party/forked/golang/expansion``):
    a defined variable is replaced, an undefined one stays as written, ``$$`` is a literal ``$``."""

    def one(match: re.Match[str]) -> str:
        if match.group(0) == "$$":
            return "$"
        return env.get(match.group(1), match.group(0))

    return VAR_REFERENCE.sub(one, text)


def container_env(pod: Mapping[str, Any], container: Mapping[str, Any]) -> tuple[tuple[str, str], ...]:
    """Literal values (expanded against the variables before them, as the kubelet does) and downward-API field
    references; secret/configmap references are not resolved."""
    env: dict[str, str] = {}
    for var in container.get("env") or []:
        if "value" in var:
            env[var["name"]] = expand(str(var["value"]), env)
            continue
        field_path = (var.get("valueFrom") or {}).get("fieldRef", {}).get("fieldPath")
        getter = _FIELD_PATHS.get(field_path or "")
        value = getter(pod) if getter else None
        if value is not None:
            env[var["name"]] = str(value)
    return tuple(env.items())


def pod_key(pod: Mapping[str, Any]) -> str:
    meta = pod["metadata"]
    return f"{meta.get('namespace', 'default')}/{meta['name']}"


def desired_launches(pods: Sequence[Mapping[str, Any]], rule: SimulateRule) -> dict[str, Launch]:
    """uid -> Launch for every matching pod that is Running with an IP and not being deleted."""
    wanted: dict[str, Launch] = {}
    for pod in pods:
        status = pod.get("status") or {}
        ip = status.get("podIP")
        if pod["metadata"].get("deletionTimestamp") or status.get("phase") != "Running" or not ip:
            continue
        container = rule.container(pod)
        if container is None:
            continue
        env = container_env(pod, container)
        command = [
            expand(word, dict(env)) for word in (*(container.get("command") or ()), *(container.get("args") or ()))
        ]
        try:
            args = sglang_server_args(command)
        except NotAnSGLangCommandError as err:
            log.warning("pod not simulated", extra={"pod": pod_key(pod), "error": str(err)})
            continue
        uid = pod["metadata"]["uid"]
        wanted[uid] = Launch(pod_key(pod), uid, ip, args, env)
    return wanted


ADDRESS_FLAGS = ("--dist-init-addr",)


def service_refs(launch: Launch) -> set[tuple[str, str]]:
    """(namespace, service) of every Service DNS name the launch's address flags point at."""
    refs = set()
    for flag in ADDRESS_FLAGS:
        value = _flag_value(launch.server_args, flag)
        match = SERVICE_HOST.match((value or "").rpartition(":")[0])
        if match:
            refs.add((match["ns"], match["svc"]))
    return refs


def resolve_services(launch: Launch, addresses: Mapping[tuple[str, str], str]) -> Launch | None:
    """The launch with each Service name in its address flags replaced by ``addresses``; None if one is missing."""
    args = list(launch.server_args)
    for i, arg in enumerate(args[:-1]):
        if arg not in ADDRESS_FLAGS:
            continue
        host, _, port = args[i + 1].rpartition(":")
        match = SERVICE_HOST.match(host)
        if match:
            ip = addresses.get((match["ns"], match["svc"]))
            if ip is None:
                return None
            args[i + 1] = f"{ip}:{port}"
    return dataclasses.replace(launch, server_args=tuple(args))


def tandem_sim_argv(launch: Launch) -> list[str]:
    """The default launcher: the simulated SGLang worker with the pod's server flags."""
    return [sys.executable, "-m", "tandem.cli", "sim", *launch.server_args]


class PodRunner:
    """Keeps one sandboxed process per simulated pod running and reports it as a kubelet would:
    ``async with runner.running_in_background():`` (or ``run()`` until cancelled, then ``stop_all()``).

    Each pod gets its own network namespace on ``network`` (the dev cluster's pod bridge, ``podnet``); its
    container's status, restarts and Ready condition come from ``PodWorker``.
    """

    def __init__(
        self,
        api: client.ApiClient,
        log_dir: Path,
        rule: SimulateRule | None = None,
        launcher: Callable[[Launch], list[str]] = tandem_sim_argv,
        namespace: str | None = None,
        network: PodNetwork | None = None,
    ) -> None:
        self.api = api
        self.log_dir = log_dir
        self.rule = rule or SimulateRule()
        self.launcher = launcher
        self.namespace = namespace
        self.network = network or PodNetwork(DevClusterConfig().pod_cidr)
        self.pods: dict[str, dict[str, Any]] = {}  # uid -> pod, the watch's view
        self.workers: dict[str, tuple[Launch, PodWorker]] = {}
        self.selectors: dict[tuple[str, str], dict[str, str]] = {}  # Services named by pods' flags
        self._session: aiohttp.ClientSession | None = None

    @property
    def running(self) -> dict[str, tuple[Launch, ManagedProcess]]:
        """uid -> (launch, current container process) of every pod whose container has been started."""
        return {
            uid: (launch, worker.process)
            for uid, (launch, worker) in self.workers.items()
            if worker.process is not None
        }

    async def resync(self, node: str) -> list[str]:
        """Report again the status of every pod on ``node``, as its kubelet does once it reaches the API server
        again: while the node's Lease was not renewed the node controller marked its pods NotReady, and the kubelet's
        status sync puts back what its probes say. Returns the pods (``namespace/name``)."""
        synced = []
        for launch, worker in list(self.workers.values()):
            if (worker.pod.get("spec") or {}).get("nodeName") == node:
                await worker.resync()
                synced.append(launch.pod)
        return synced

    def sandbox(self, pod: str) -> Sandbox:
        """The network sandbox of pod ``namespace/name`` (for network faults)."""
        for launch, worker in self.workers.values():
            if launch.pod == pod and worker.sandbox is not None:
                return worker.sandbox
        raise KeyError(f"no sandbox for pod {pod}")

    async def run(self) -> None:
        core = client.CoreV1Api(self.api)
        while True:
            pods = await self._list(core)
            self.pods = {p["metadata"]["uid"]: p for p in pods["items"]}
            await self.reconcile()
            resource_version = pods["metadata"]["resourceVersion"]
            with contextlib.suppress(client.ApiException):  # 410 Gone etc.: list again
                await self._watch(core, resource_version)

    async def _list(self, core: client.CoreV1Api) -> dict[str, Any]:
        if self.namespace:
            pods = await core.list_namespaced_pod(self.namespace)
        else:
            pods = await core.list_pod_for_all_namespaces()
        data: dict[str, Any] = self.api.sanitize_for_serialization(pods)
        return data

    async def _watch(self, core: client.CoreV1Api, resource_version: str) -> None:
        func = core.list_namespaced_pod if self.namespace else core.list_pod_for_all_namespaces
        args = [self.namespace] if self.namespace else []
        async with watch.Watch() as w:
            async for event in w.stream(func, *args, resource_version=resource_version, timeout_seconds=300):
                pod: dict[str, Any] = event["raw_object"]
                if event["type"] == "ERROR":
                    return
                uid = pod["metadata"]["uid"]
                if event["type"] == "DELETED":
                    self.pods.pop(uid, None)
                else:
                    self.pods[uid] = pod
                await self.reconcile()

    async def reconcile(self) -> None:
        """Stop workers whose pod is gone, terminal or changed; start missing ones. A worker restarts its own
        container per restartPolicy; a pod whose container ended for good turns Failed/Succeeded and goes."""
        wanted = await self._resolve(desired_launches(list(self.pods.values()), self.rule))
        for uid, (launch, worker) in list(self.workers.items()):
            if wanted.get(uid) != launch:
                log.info("stopping simulated pod", extra={"pod": launch.pod, "uid": uid})
                await worker.stop()  # stays listed until stopped: stop_all() finishes it if this is cancelled
                del self.workers[uid]
            elif uid in self.pods:
                worker.pod = self.pods[uid]
        for uid, launch in wanted.items():
            if uid not in self.workers:
                await self._start(launch)

    async def _resolve(self, launches: dict[str, Launch]) -> dict[str, Launch]:
        addresses = await self._addresses(set().union(*(service_refs(launch) for launch in launches.values())))
        resolved = {uid: resolve_services(launch, addresses) for uid, launch in launches.items()}
        return {uid: launch for uid, launch in resolved.items() if launch is not None}

    async def _addresses(self, refs: set[tuple[str, str]]) -> dict[tuple[str, str], str]:
        """The pod IP each Service resolves to now (the dev cluster has no DNS)."""
        pods = list(self.pods.values())
        addresses: dict[tuple[str, str], str] = {}
        for ref in refs:
            selector = self.selectors.get(ref) or await self._selector(*ref)
            ip = selected_pod_ip(pods, ref[0], selector) if selector else None
            if ip is not None:
                addresses[ref] = ip
        return addresses

    async def resolve_command(self, words: Sequence[str]) -> list[str]:
        """A hook's command with the Service names in its URLs resolved (``PodWorker`` runs preStop hooks)."""
        return resolve_urls(words, await self._addresses(url_service_refs(words)))

    async def _selector(self, namespace: str, name: str) -> dict[str, str]:
        try:
            service = await client.CoreV1Api(self.api).read_namespaced_service(name, namespace)
        except client.ApiException:
            return {}
        selector = dict(service.spec.selector or {})
        if selector:
            self.selectors[(namespace, name)] = selector
        return selector

    async def _start(self, launch: Launch) -> None:
        pod = self.pods[launch.uid]
        container = self.rule.container(pod)
        assert container is not None  # desired_launches only returns pods the rule matches
        if self._session is None:
            self._session = aiohttp.ClientSession(connector=aiohttp.TCPConnector(force_close=True))
        log.info("starting simulated pod", extra={"pod": launch.pod, "uid": launch.uid, "host": launch.host})
        worker = PodWorker(
            pod,
            container,
            launch.host,
            lambda: self.launcher(launch),
            dict(launch.env),
            self.log_dir,
            self.api,
            self._session,
            self.resolve_command,
        )
        self.workers[launch.uid] = (launch, worker)  # listed first: stop_all() removes a half-started sandbox
        try:
            await worker.start(self.network)
        except PodNetworkError as err:  # this pod only: tried again at its next event
            log.error("pod sandbox failed", extra={"pod": launch.pod, "error": str(err)})
            del self.workers[launch.uid]

    @contextlib.asynccontextmanager
    async def running_in_background(self) -> AsyncIterator[PodRunner]:
        """Watch and run pods while the block runs; stop the watch and every process on the way out."""
        if not self.network.exists():
            raise PodNetworkError(f"no pod network {self.network.cidr} here: start the dev cluster (in this namespace)")
        task = asyncio.create_task(self.run(), name="pod-runner")
        try:
            yield self
        finally:
            task.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await task
            await self.stop_all()

    async def stop_all(self) -> None:
        """Stop every container and remove every sandbox this runner made."""
        while self.workers:
            uid, (_, worker) = next(iter(self.workers.items()))
            await worker.stop()
            del self.workers[uid]
        if self._session is not None:
            await self._session.close()
            self._session = None
