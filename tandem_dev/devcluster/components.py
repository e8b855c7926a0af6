"""Command lines of the control-plane components (pure functions of the cluster layout).

Everything binds 127.0.0.1: the test suite runs in a loopback-only network namespace, where the API server
cannot discover an address of its own (hence ``--advertise-address``) and nothing else is reachable anyway.
"""

from __future__ import annotations

import ipaddress
from dataclasses import dataclass
from pathlib import Path

from tandem_dev.devcluster.config import DevClusterConfig
from tandem_dev.devcluster.nodes import KWOK_ANNOTATION

HOST = "127.0.0.1"
# Client-side rate limits of kube-controller-manager and kube-scheduler (defaults 20/30 and 50/100). At 1,000
# nodes the node lifecycle controller removes 1,000 not-ready taints (a GET and a PATCH each) and the scheduler
# binds 1,000 pods: at the defaults that alone took more than two minutes.
CLIENT_RATE = ("--kube-api-qps=200", "--kube-api-burst=400")
SERVICE_ACCOUNT_ISSUER = "https://kubernetes.default.svc.cluster.local"
# kube-controller-manager controllers the dev cluster turns off (``--controllers=*,-name,...``): each writes or
# reads on every pod, node or Service change, and nothing in the dev cluster or what Tandem tests consumes its
# output. At 1,000 nodes and 250 groups they cost the API server thousands of writes during a ramp.
DISABLED_CONTROLLERS = (
    # Endpoints and EndpointSlices feed kube-proxy and DNS, which the dev cluster has not: the pod runner resolves
    # a Service from the pods it selects, and the operator and routers find workers through the registry.
    "endpoints-controller",
    "endpointslice-controller",
    "endpointslice-mirroring-controller",
    # Annotates every Node with the kubelet's ConfigMap/Secret cache TTL; kwok nodes have no kubelet.
    "ttl-controller",
    # PodDisruptionBudget status only feeds the eviction API; no Tandem test evicts (the operator creates the
    # PDBs, whose spec a test checks; a drain goes through the pool's scale).
    "disruption-controller",
    # Volumes that no Tandem pod uses: attachable ones (no kubelet mounts anything), generic ephemeral volumes and
    # DRA claims. The claim controllers stay (the chart's etcd StatefulSet makes PersistentVolumeClaims, and
    # tests/chart/test_chart_uninstall_k8s.py checks they outlive an uninstall).
    "persistentvolume-attach-detach-controller",
    "ephemeral-volume-controller",
    "resourceclaim-controller",
    "device-taint-eviction-controller",
)


@dataclass(frozen=True)
class Ports:
    etcd_client: int
    etcd_peer: int
    apiserver: int
    controller_manager: int
    scheduler: int


@dataclass(frozen=True)
class Layout:
    """Where one cluster keeps its files. ``root`` holds pki/, etcd/, logs/ and the kubeconfigs."""

    root: Path
    ports: Ports

    @property
    def pki(self) -> Path:
        return self.root / "pki"

    @property
    def logs(self) -> Path:
        return self.root / "logs"

    @property
    def etcd_data(self) -> Path:
        return self.root / "etcd"

    @property
    def etcd_url(self) -> str:
        return f"http://{HOST}:{self.ports.etcd_client}"

    @property
    def server(self) -> str:
        return f"https://{HOST}:{self.ports.apiserver}"

    def kubeconfig(self, identity: str) -> Path:
        return self.root / f"kubeconfig-{identity}.yaml"


def etcd_argv(binary: Path, layout: Layout) -> list[str]:
    peer = f"http://{HOST}:{layout.ports.etcd_peer}"
    return [
        str(binary),
        "--name=dev",
        f"--data-dir={layout.etcd_data}",
        f"--listen-client-urls={layout.etcd_url}",
        f"--advertise-client-urls={layout.etcd_url}",
        f"--listen-peer-urls={peer}",
        f"--initial-advertise-peer-urls={peer}",
        f"--initial-cluster=dev={peer}",
        "--unsafe-no-fsync",
        "--log-level=warn",
    ]


def apiserver_argv(binary: Path, layout: Layout, config: DevClusterConfig) -> list[str]:
    pki = layout.pki
    return [
        str(binary),
        f"--etcd-servers={layout.etcd_url}",
        f"--bind-address={HOST}",
        f"--advertise-address={HOST}",
        f"--secure-port={layout.ports.apiserver}",
        f"--tls-cert-file={pki / 'apiserver.crt'}",
        f"--tls-private-key-file={pki / 'apiserver.key'}",
        f"--client-ca-file={pki / 'ca.crt'}",
        f"--service-cluster-ip-range={config.service_cidr}",
        f"--service-account-issuer={SERVICE_ACCOUNT_ISSUER}",
        f"--service-account-key-file={pki / 'sa.pub'}",
        f"--service-account-signing-key-file={pki / 'sa.key'}",
        "--authorization-mode=RBAC",
        "--allow-privileged=true",
        # The "kubernetes" Service would point at 127.0.0.1, which Endpoints validation rejects; nothing in a
        # kwok pod calls it.
        "--endpoint-reconciler-type=none",
        "--profiling=false",
    ]


def controller_manager_argv(binary: Path, layout: Layout, config: DevClusterConfig) -> list[str]:
    kubeconfig = layout.kubeconfig("controller-manager")
    return [
        str(binary),
        f"--kubeconfig={kubeconfig}",
        f"--bind-address={HOST}",
        f"--secure-port={layout.ports.controller_manager}",
        f"--cert-dir={layout.root / 'controller-manager-certs'}",
        f"--service-account-private-key-file={layout.pki / 'sa.key'}",
        f"--root-ca-file={layout.pki / 'ca.crt'}",
        f"--service-cluster-ip-range={config.service_cidr}",
        "--use-service-account-credentials=true",
        f"--node-monitor-grace-period={config.node_monitor_grace_seconds}s",
        "--controllers=" + ",".join(["*", *(f"-{name}" for name in DISABLED_CONTROLLERS)]),
        *CLIENT_RATE,
        "--leader-elect=false",
        "--profiling=false",
    ]


def scheduler_argv(binary: Path, layout: Layout) -> list[str]:
    kubeconfig = layout.kubeconfig("scheduler")
    return [
        str(binary),
        f"--kubeconfig={kubeconfig}",
        *CLIENT_RATE,  # deprecated flags, still honoured without a --config file
        f"--bind-address={HOST}",
        f"--secure-port={layout.ports.scheduler}",
        f"--cert-dir={layout.root / 'scheduler-certs'}",
        "--leader-elect=false",
        "--profiling=false",
    ]


def first_pod_ip_cidr(pod_cidr: str) -> str:
    """kwok hands out pod IPs counting up from the address in ``--cidr``: start at the first host, so no pod gets
    the network address (127.10.0.0 is not connectable)."""
    net = ipaddress.ip_network(pod_cidr)
    return f"{net.network_address + 1}/{net.prefixlen}"


def kwok_argv(binary: Path, layout: Layout, config: DevClusterConfig, stages: Path) -> list[str]:
    key, value = KWOK_ANNOTATION
    return [
        str(binary),
        f"--kubeconfig={layout.kubeconfig('kwok')}",
        f"--config={stages}",
        f"--manage-nodes-with-annotation-selector={key}={value}",
        f"--cidr={first_pod_ip_cidr(config.pod_cidr)}",
        f"--node-ip={config.node_ip_base}",
        f"--node-lease-duration-seconds={config.node_lease_seconds}",
    ]


PROBE_READINESS = "{{ $probeReadiness := true }}"


def kwok_stages(template: str, config: DevClusterConfig) -> str:
    """kwok-stages.yaml for this cluster: probed pods start NotReady unless ``config.kwok_marks_ready``."""
    if PROBE_READINESS not in template:
        raise ValueError(f"kwok stages lack the {PROBE_READINESS} switch")
    return (
        template.replace(PROBE_READINESS, PROBE_READINESS.replace("true", "false"))
        if config.kwok_marks_ready
        else template
    )
