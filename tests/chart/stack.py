"""The chart's workloads run for real on the test control plane, as far as a GPU-free, container-free cluster allows.

Pods on kwok nodes run no containers, so what the chart's Deployments would run is run here as local processes
from the Deployments' own argv (read back from the API server after ``helm install``), on loopback:

- the operator under the chart's ServiceAccount: a TokenRequest token for it in a kubeconfig, so every API call
  it makes is authorized by the chart's ClusterRole (real RBAC);
- the router with the chart's flags (only ``--host``/``--port`` moved to a free loopback port);
- the registry etcd (``etcd.mode: external``) from Debian's etcd-server;
- ``tandem sim`` behind each SGLang pod's IP (the dev cluster's pod runner).
"""

from __future__ import annotations

import abc
import asyncio
import contextlib
import json
import os
import sys
from collections.abc import AsyncIterator, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from kubernetes_asyncio import client
from openai import AsyncOpenAI, OpenAIError

from tandem_dev.devcluster.cluster import DevCluster
from tandem_dev.devcluster.podrunner import PodRunner
from tandem_dev.procs import ManagedProcess, free_port

REPO = Path(__file__).resolve().parents[2]
CHART = REPO / "charts" / "tandem"
DEPLOY = REPO / "deploy"


async def tool(cluster: DevCluster, name: str, *args: str, check: bool = True, stdin: bytes | None = None) -> str:
    """Run the cluster's ``kubectl``/``helm`` as admin; returns stdout. ``check`` fails the test on a non-zero exit."""
    proc = await asyncio.create_subprocess_exec(
        str(cluster.tool(name)),
        *args,
        env={**os.environ, **cluster.env()},
        stdin=asyncio.subprocess.PIPE if stdin is not None else asyncio.subprocess.DEVNULL,
        stdout=asyncio.subprocess.PIPE,
        stderr=asyncio.subprocess.PIPE,
    )
    async with asyncio.timeout(120):
        out, err = await proc.communicate(stdin)
    if check:
        assert proc.returncode == 0, (
            f"{name} {' '.join(args)} failed ({proc.returncode}):\n{err.decode()}{out.decode()}"
        )
    return out.decode()


def start_etcd(tmp_path: Path, procs: list[ManagedProcess]) -> str:
    """The registry etcd (Debian etcd-server) on a free loopback port; returns ``127.0.0.1:port``."""
    client_port, peer_port = free_port(), free_port()
    url, peer = f"http://127.0.0.1:{client_port}", f"http://127.0.0.1:{peer_port}"
    argv = ["etcd", "--data-dir", str(tmp_path / "etcd"), "--listen-client-urls", url, "--advertise-client-urls", url]
    argv += ["--listen-peer-urls", peer, "--initial-advertise-peer-urls", peer, "--initial-cluster", f"default={peer}"]
    proc = ManagedProcess("registry-etcd", argv, tmp_path / "registry-etcd.log").start()
    procs.append(proc)
    proc.wait_http(f"{url}/health", timeout=30)
    return f"127.0.0.1:{client_port}"


async def container_args(api: client.ApiClient, namespace: str, deployment: str) -> list[str]:
    """The argv the chart gives the Deployment's only container."""
    dep = await client.AppsV1Api(api).read_namespaced_deployment(deployment, namespace)
    (container,) = dep.spec.template.spec.containers
    return list(container.args)


def _replace_flag(args: Sequence[str], flag: str, value: str) -> list[str]:
    assert any(a.startswith(f"{flag}=") for a in args), f"the chart no longer passes {flag}: {args}"
    return [f"{flag}={value}" if a.startswith(f"{flag}=") else a for a in args]


async def service_account_kubeconfig(cluster: DevCluster, api: client.ApiClient, namespace: str, account: str) -> Path:
    """A kubeconfig holding a TokenRequest token of ``namespace/account``: what the pod's projected token would be."""
    spec = client.V1TokenRequestSpec(audiences=[], expiration_seconds=3600)
    request = client.AuthenticationV1TokenRequest(spec=spec)
    token = await client.CoreV1Api(api).create_namespaced_service_account_token(account, namespace, request)
    return cluster.token_kubeconfig(f"system:serviceaccount:{namespace}:{account}", token.status.token, namespace)


@dataclass
class LocalDeployment:
    """Local processes standing in for one Deployment's pods; ``roll`` replaces them like a rolling update."""

    name: str
    tmp_path: Path
    procs: list[ManagedProcess]
    env: dict[str, str] = field(default_factory=dict)
    generation: int = 0
    current: ManagedProcess | None = None
    url: str = ""

    def start(self, args: Sequence[str], port_flag: str, extra: Sequence[str] = (), ready: str = "/health") -> str:
        """Start one replica with the chart's ``args`` on a free port; returns its base URL once ``ready`` answers."""
        port = free_port()
        argv = [sys.executable, "-m", "tandem.cli", *_replace_flag(args, port_flag, str(port)), *extra]
        self.generation += 1
        name = f"{self.name}-{self.generation}"
        env = {**self.env, "POD_NAME": name}
        proc = ManagedProcess(name, argv, self.tmp_path / f"{name}.log", env=env).start()
        self.procs.append(proc)
        url = f"http://127.0.0.1:{port}"
        proc.wait_http(f"{url}{ready}", timeout=60)
        self.current, self.url = proc, url
        return url


async def router_args(api: client.ApiClient, namespace: str, release: str) -> list[str]:
    return _replace_flag(await container_args(api, namespace, f"{release}-router"), "--host", "127.0.0.1")


async def operator_args(api: client.ApiClient, namespace: str, release: str, kubeconfig: Path) -> list[str]:
    args = await container_args(api, namespace, f"{release}-operator")
    return [*args, f"--kubeconfig={kubeconfig}", "--metrics-host=127.0.0.1"]


@contextlib.asynccontextmanager
async def pod_runner(api: client.ApiClient, namespace: str, log_dir: Path) -> AsyncIterator[PodRunner]:
    """``tandem sim`` behind every SGLang pod of ``namespace`` while the block runs."""
    async with PodRunner(api, log_dir, namespace=namespace).running_in_background() as runner:
        yield runner


def pdcluster_manifest(namespace: str, etcd: str) -> dict[str, Any]:
    """deploy/sim-small.yaml, moved to the test's namespace and registry etcd."""
    import yaml

    doc: dict[str, Any] = yaml.safe_load((DEPLOY / "sim-small.yaml").read_text())
    doc["metadata"]["namespace"] = namespace
    doc["spec"]["etcd"]["endpoints"] = [f"http://{etcd}"]
    return doc


# Objects a namespace has whatever is installed into it; not the chart's to delete.
_NAMESPACE_BUILTINS = {("ServiceAccount", "default"), ("ConfigMap", "kube-root-ca.crt")}
_EPHEMERAL_KINDS = {"Event"}


async def namespace_objects(cluster: DevCluster, namespace: str) -> list[tuple[str, str]]:
    """(kind, name) of every listable namespaced object in ``namespace``, builtins and Events left out."""
    kinds = (await tool(cluster, "kubectl", "api-resources", "--verbs=list", "--namespaced", "-o", "name")).split()
    listing = json.loads(await tool(cluster, "kubectl", "get", ",".join(kinds), "-n", namespace, "-o", "json"))
    found = {(item["kind"], item["metadata"]["name"]) for item in listing["items"]}
    return sorted(o for o in found if o not in _NAMESPACE_BUILTINS and o[0] not in _EPHEMERAL_KINDS)


async def cluster_objects_of_release(cluster: DevCluster, release: str) -> list[tuple[str, str]]:
    """(kind, name) of cluster-scoped objects labelled with the release (ClusterRole, ClusterRoleBinding, ...)."""
    kinds = (
        await tool(cluster, "kubectl", "api-resources", "--verbs=list", "--namespaced=false", "-o", "name")
    ).split()
    selector = f"app.kubernetes.io/instance={release}"
    listing = json.loads(await tool(cluster, "kubectl", "get", ",".join(kinds), "-l", selector, "-o", "json"))
    return sorted((item["kind"], item["metadata"]["name"]) for item in listing["items"])


@dataclass
class EndpointLoad(abc.ABC):
    """A request loop through a Service: each request goes to the next of the Service's ready ``endpoints`` (round
    robin, as kube-proxy spreads connections); ``endpoints`` is edited while it runs, as Endpoints are. It runs
    until ``stop`` is set (or ``max_requests`` were sent), ``concurrency`` requests at a time, one SDK client per
    endpoint with no retries (a failed request must show up, not be hidden by a second try); ``request`` is the
    kind of load."""

    model: str
    endpoints: list[str]
    max_requests: int = 3000
    concurrency: int = 2
    stop: asyncio.Event = field(default_factory=asyncio.Event)
    served: dict[str, int] = field(default_factory=dict)
    _issued: int = 0

    @property
    def ok(self) -> int:
        return sum(self.served.values())

    async def run(self) -> None:
        clients: dict[str, AsyncOpenAI] = {}
        try:
            await asyncio.gather(*(self._worker(clients) for _ in range(self.concurrency)))
        finally:
            for sdk in clients.values():
                await sdk.close()

    async def _worker(self, clients: dict[str, AsyncOpenAI]) -> None:
        while self._issued < self.max_requests and not self.stop.is_set():
            base = self.endpoints[self._issued % len(self.endpoints)]
            self._issued += 1
            sdk = clients.setdefault(base, AsyncOpenAI(base_url=f"{base}/v1", api_key="none", max_retries=0))
            if await self.request(sdk, base, self._issued):
                self.served[base] = self.served.get(base, 0) + 1

    @abc.abstractmethod
    async def request(self, sdk: AsyncOpenAI, base: str, n: int) -> bool:
        """Send request ``n`` to ``base``; True when it was served, else it is recorded as this load records it."""


@dataclass
class ServiceLoad(EndpointLoad):
    """Short completions; ``failures`` lists every request not served, with why."""

    failures: list[str] = field(default_factory=list)

    async def request(self, sdk: AsyncOpenAI, base: str, n: int) -> bool:
        try:
            out = await sdk.completions.create(model=self.model, prompt="upgrade probe", max_tokens=4, timeout=30)
        except OpenAIError as err:
            self.failures.append(f"{base}: {type(err).__name__}: {err}")
            return False
        if out.usage is not None and out.usage.completion_tokens > 0:
            return True
        self.failures.append(f"{base}: empty completion {out}")
        return False
