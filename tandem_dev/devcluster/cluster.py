"""Start and stop a real Kubernetes control plane on loopback: etcd, kube-apiserver, kube-controller-manager,
kube-scheduler and kwok with fake GPU nodes.

Components start in dependency order, each waited for by a readiness check, and run as ManagedProcess (own
process group, log file under ``<root>/logs``). Any failure while starting stops what already started, so no
process outlives a failed start; ``stop()`` stops everything in reverse order.
"""

from __future__ import annotations

import ipaddress
import json
import logging
import ssl
import time
import urllib.error
import urllib.request
from collections.abc import Callable, Iterable
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any

from tandem_dev.devcluster import components, pki
from tandem_dev.devcluster.config import DevClusterConfig, default_bin_dir, require_binaries
from tandem_dev.devcluster.kubeconfig import kubeconfig, write_kubeconfig
from tandem_dev.devcluster.nodes import fake_nodes
from tandem_dev.devcluster.podnet import PodNetwork
from tandem_dev.procs import ManagedProcess, free_port

STAGES = Path(__file__).with_name("kwok-stages.yaml")
CREATE_THREADS = 8  # concurrent node creates (one TLS connection each); 1,000 one by one took ~10 s
PROGRESS_EVERY_S = 5.0
log = logging.getLogger("tandem_dev.devcluster")
# Identities of the components (CN = user, O = groups); the bootstrap RBAC roles of a real cluster apply to them.
IDENTITIES: dict[str, tuple[str, tuple[str, ...]]] = {
    "admin": ("tandem-admin", ("system:masters",)),
    "controller-manager": ("system:kube-controller-manager", ()),
    "scheduler": ("system:kube-scheduler", ()),
    "kwok": ("kwok", ("system:masters",)),
}


class ClusterStartError(RuntimeError):
    """The cluster did not come up; the message names the component and carries its log tail."""


class _Api:
    """A minimal synchronous client for bootstrap and readiness checks (tests use kubernetes_asyncio)."""

    def __init__(self, server: str, ca: Path, cert: pki.CertPair) -> None:
        self.server = server
        self.context = ssl.create_default_context(cafile=str(ca))
        self.context.load_cert_chain(str(cert.cert), str(cert.key))

    def request(self, method: str, path: str, body: dict[str, Any] | None = None) -> tuple[int, Any]:
        data = json.dumps(body).encode() if body is not None else None
        req = urllib.request.Request(f"{self.server}{path}", data=data, method=method)
        req.add_header("Content-Type", "application/json")
        try:
            with urllib.request.urlopen(req, timeout=5, context=self.context) as resp:
                raw = resp.read()
                status = int(resp.status)
        except urllib.error.HTTPError as err:
            raw, status = err.read(), err.code
        try:
            return status, json.loads(raw)
        except ValueError:
            return status, raw.decode(errors="replace")


def _http_ok(url: str) -> bool:
    try:
        with urllib.request.urlopen(url, timeout=2) as resp:
            return int(resp.status) == 200
    except (OSError, urllib.error.URLError):
        return False


def _https_ok(url: str) -> bool:
    """GET ``url`` on a component's self-signed health endpoint (loopback only, so the cert is not verified)."""
    context = ssl.SSLContext(ssl.PROTOCOL_TLS_CLIENT)
    context.check_hostname = False
    context.verify_mode = ssl.CERT_NONE
    try:
        with urllib.request.urlopen(url, timeout=2, context=context) as resp:
            return int(resp.status) == 200
    except (OSError, urllib.error.URLError):
        return False


def node_ready(node: dict[str, Any]) -> bool:
    """Ready condition True and no NoSchedule/NoExecute taint left by the node lifecycle controller."""
    conditions = node.get("status", {}).get("conditions", [])
    ready = any(c.get("type") == "Ready" and c.get("status") == "True" for c in conditions)
    taints = node.get("spec", {}).get("taints", [])
    return ready and not any(t.get("effect") in {"NoSchedule", "NoExecute"} for t in taints)


def fleet_progress(nodes: list[dict[str, Any]]) -> tuple[int, int, int]:
    """(registered, Ready condition True, schedulable: Ready and the not-ready taint removed) of a node list."""
    ready = sum(
        any(c.get("type") == "Ready" and c.get("status") == "True" for c in n.get("status", {}).get("conditions", []))
        for n in nodes
    )
    return len(nodes), ready, sum(node_ready(n) for n in nodes)


class DevCluster:
    """One control plane under ``root``. Use as a context manager, or call ``start()`` and ``stop()``."""

    def __init__(self, root: Path, config: DevClusterConfig | None = None, bin_dir: Path | None = None) -> None:
        self.config = config or DevClusterConfig()
        self.bin_dir = bin_dir or default_bin_dir()
        self.binaries = require_binaries(self.bin_dir)
        ports = components.Ports(*(free_port() for _ in range(5)))
        self.layout = components.Layout(root, ports)
        self.processes: list[ManagedProcess] = []
        self.pod_network: PodNetwork | None = None
        self.timings: dict[str, float] = {}
        self._progress_at = 0.0  # when node registration progress was last logged
        self._ca: pki.CertPair | None = None
        self._api: _Api | None = None

    # -- public surface -------------------------------------------------------------------------------------
    @property
    def server(self) -> str:
        return self.layout.server

    @property
    def kubeconfig(self) -> Path:
        """The admin kubeconfig (user ``tandem-admin`` in ``system:masters``)."""
        return self.layout.kubeconfig("admin")

    @property
    def ca_cert(self) -> Path:
        return self.layout.pki / "ca.crt"

    def env(self) -> dict[str, str]:
        """Environment for kubectl/helm subprocesses: the admin KUBECONFIG; Helm's state inside the cluster dir."""
        helm = self.layout.root / "helm"
        return {
            "KUBECONFIG": str(self.kubeconfig),
            "HELM_CACHE_HOME": str(helm / "cache"),
            "HELM_CONFIG_HOME": str(helm / "config"),
            "HELM_DATA_HOME": str(helm / "data"),
        }

    def tool(self, name: str) -> Path:
        """Path of a built binary: kubectl, helm, etcd, kwok, ..."""
        return self.binaries[name]

    def logs(self) -> dict[str, Path]:
        return {proc.name: proc.log_path for proc in self.processes}

    def mint_user(self, user: str, groups: tuple[str, ...] = (), namespace: str = "default") -> Path:
        """A kubeconfig for a new client-certificate identity (user ``user`` in ``groups``); RBAC decides the rest."""
        cert = pki.issue_client_cert(self._require_ca(), self.layout.pki, user, groups)
        doc = kubeconfig(
            self.server, self.ca_cert, user, client_cert=cert.cert, client_key=cert.key, namespace=namespace
        )
        return write_kubeconfig(self.layout.kubeconfig(f"user-{cert.cert.stem}"), doc)

    def token_kubeconfig(self, name: str, token: str, namespace: str = "default") -> Path:
        """A kubeconfig that authenticates with a bearer token (e.g. a ServiceAccount's TokenRequest token)."""
        doc = kubeconfig(self.server, self.ca_cert, name, token=token, namespace=namespace)
        return write_kubeconfig(self.layout.kubeconfig(f"token-{name.replace(':', '_')}"), doc)

    def start(self, timeout: float | None = None) -> DevCluster:
        """Start every component; ``timeout`` defaults to ``config.start_timeout_seconds`` (grows with nodes)."""
        timeout = self.config.start_timeout_seconds if timeout is None else timeout
        began = time.monotonic()
        deadline = began + timeout
        try:
            self._start(deadline)
        except BaseException:
            self.stop()
            raise
        self.timings["total"] = time.monotonic() - began
        return self

    def stop(self) -> None:
        """Stop every component, newest first, then remove the pod bridge. Safe to call twice."""
        while self.processes:
            self.processes.pop().stop(timeout=15)
        if self.pod_network is not None:
            self.pod_network.delete()
            self.pod_network = None

    def __enter__(self) -> DevCluster:
        return self.start()

    def __exit__(self, *exc: object) -> None:
        self.stop()

    # -- startup ----------------------------------------------------------------------------------------------
    def wait_established(self, crds: Iterable[str], timeout: float = 60.0) -> None:
        """Block until every named CRD (``pdclusters.tandem.dev``, ...) has condition Established=True.

        ``kubectl wait --for=condition=Established`` fails at once ("accessor error: <nil>") when it reads a CRD
        before the API server wrote its first status, which a loaded machine makes likely right after an apply.
        """
        deadline = time.monotonic() + timeout
        pending = list(crds)
        while pending:
            status, body = self._api_client().request(
                "GET", f"/apis/apiextensions.k8s.io/v1/customresourcedefinitions/{pending[0]}"
            )
            conditions = (body.get("status") or {}).get("conditions") or [] if isinstance(body, dict) else []
            if status == 200 and any(c.get("type") == "Established" and c.get("status") == "True" for c in conditions):
                pending.pop(0)
                continue
            if time.monotonic() > deadline:
                raise TimeoutError(f"CRD {pending[0]} not Established after {timeout:.0f} s (last: {status} {body})")
            time.sleep(0.2)

    def _require_ca(self) -> pki.CertPair:
        if self._ca is None:
            raise ClusterStartError("the cluster's CA does not exist yet: start() the cluster first")
        return self._ca

    def _api_client(self) -> _Api:
        if self._api is None:
            raise ClusterStartError("the API server is not started")
        return self._api

    def _timed(self, step: str, began: float) -> None:
        self.timings[step] = time.monotonic() - began

    def _start(self, deadline: float) -> None:
        layout = self.layout
        for directory in (layout.pki, layout.logs, layout.etcd_data):
            directory.mkdir(mode=0o700, parents=True, exist_ok=True)
        began = time.monotonic()
        self._make_credentials()
        self._timed("pki", began)

        began = time.monotonic()
        etcd = self._launch("etcd", components.etcd_argv(self.binaries["etcd"], layout))
        self._wait(etcd, "/health", deadline, lambda: _http_ok(f"{layout.etcd_url}/health"))
        self._timed("etcd", began)

        began = time.monotonic()
        apiserver = self._launch(
            "kube-apiserver", components.apiserver_argv(self.binaries["kube-apiserver"], layout, self.config)
        )
        self._wait(apiserver, "/readyz", deadline, lambda: self._api_client().request("GET", "/readyz")[0] == 200)
        self._timed("kube-apiserver", began)

        began = time.monotonic()
        kcm_argv = components.controller_manager_argv(self.binaries["kube-controller-manager"], layout, self.config)
        kcm = self._launch("kube-controller-manager", kcm_argv)
        scheduler = self._launch("kube-scheduler", components.scheduler_argv(self.binaries["kube-scheduler"], layout))
        kcm_health = f"https://{components.HOST}:{layout.ports.controller_manager}/healthz"
        scheduler_health = f"https://{components.HOST}:{layout.ports.scheduler}/healthz"
        self._wait(kcm, kcm_health, deadline, lambda: _https_ok(kcm_health))
        self._wait(scheduler, scheduler_health, deadline, lambda: _https_ok(scheduler_health))
        self._timed("controllers", began)

        began = time.monotonic()
        api = self._api_client()
        self._create_nodes()
        self._timed("nodes created", began)
        stages = self._render_stages()
        kwok = self._launch("kwok", components.kwok_argv(self.binaries["kwok"], layout, self.config, stages))
        poll = 0.1 if self.config.nodes <= 100 else 1.0  # a list of 1,000 nodes is ~5 MB of JSON
        self._wait(kwok, "all nodes Ready", deadline, self._nodes_ready, poll)
        default_sa = "/api/v1/namespaces/default/serviceaccounts/default"
        self._wait(kcm, "default ServiceAccount", deadline, lambda: api.request("GET", default_sa)[0] == 200)
        self._timed("nodes", began)

        if not self.config.kwok_marks_ready:  # pods run behind their IPs: they need the pod network
            began = time.monotonic()
            self.pod_network = PodNetwork(self.config.pod_cidr).create()
            self._timed("pod network", began)

    def _render_stages(self) -> Path:
        path = self.layout.root / STAGES.name
        path.write_text(components.kwok_stages(STAGES.read_text(), self.config))
        return path

    def _make_credentials(self) -> None:
        layout = self.layout
        self._ca = ca = pki.create_ca(layout.pki)
        pki.issue_serving_cert(
            ca,
            layout.pki,
            "apiserver",
            ips=[components.HOST, str(_first_service_ip(self.config.service_cidr))],
            dns=["localhost", "kubernetes", "kubernetes.default", "kubernetes.default.svc"],
        )
        pki.create_service_account_keys(layout.pki)
        for identity, (user, groups) in IDENTITIES.items():
            cert = pki.issue_client_cert(ca, layout.pki, user, groups)
            doc = kubeconfig(layout.server, ca.cert, user, client_cert=cert.cert, client_key=cert.key)
            write_kubeconfig(layout.kubeconfig(identity), doc)
            if identity == "admin":
                self._api = _Api(layout.server, ca.cert, cert)

    def _launch(self, name: str, argv: list[str]) -> ManagedProcess:
        proc = ManagedProcess(name=name, argv=argv, log_path=self.layout.logs / f"{name}.log", cwd=self.layout.root)
        self.processes.append(proc.start())
        return proc

    def _create_nodes(self) -> None:
        api, nodes = self._api_client(), fake_nodes(self.config)

        def create(node: dict[str, Any]) -> None:
            status, body = api.request("POST", "/api/v1/nodes", node)
            if status != 201:
                raise ClusterStartError(f"creating node {node['metadata']['name']} failed: HTTP {status} {body}")

        with ThreadPoolExecutor(CREATE_THREADS) as pool:
            for done, _ in enumerate(pool.map(create, nodes), 1):
                if done % 250 == 0 and done < len(nodes):
                    log.info("creating nodes", extra={"nodes_created": done, "nodes": len(nodes)})

    def _nodes_ready(self) -> bool:
        """All nodes Ready and schedulable; logs the counts every ``PROGRESS_EVERY_S`` while they register.
        ``resourceVersion=0`` is served from the API server's watch cache, not etcd."""
        status, body = self._api_client().request("GET", "/api/v1/nodes?labelSelector=type%3Dkwok&resourceVersion=0")
        if status != 200:
            return False
        registered, ready, schedulable = fleet_progress(body.get("items", []))
        done = schedulable == self.config.nodes
        now = time.monotonic()
        if done or now - self._progress_at >= PROGRESS_EVERY_S:
            self._progress_at = now
            progress = {"nodes": self.config.nodes, "registered": registered, "ready": ready, "untainted": schedulable}
            log.info("nodes registering", extra=progress)
        return done

    @staticmethod
    def _wait(proc: ManagedProcess, what: str, deadline: float, check: Callable[[], bool], poll: float = 0.1) -> None:
        while time.monotonic() < deadline:
            if not proc.alive():
                raise ClusterStartError(f"{proc.name} exited ({proc.returncode()}):\n{proc.log_tail()}")
            try:
                if check():
                    return
            except OSError:
                pass
            time.sleep(poll)
        raise ClusterStartError(f"{proc.name}: {what} not ready in time:\n{proc.log_tail()}")


def _first_service_ip(service_cidr: str) -> str:
    return str(next(ipaddress.ip_network(service_cidr).hosts()))
