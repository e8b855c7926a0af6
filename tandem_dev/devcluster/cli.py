"""``tandem dev-cluster``: run the real test control plane with fake GPU nodes until interrupted.

Pods get network namespaces of their own on a bridge carrying 127.10.0.0/16 (``podnet``), which may exist only
in a loopback-only network namespace made for it. Started anywhere else, the command re-runs itself in a new one
(``unshare --net``, with ``--map-root-user`` when not root) and prints how to enter it (``nsenter``).
"""

from __future__ import annotations

import argparse
import asyncio
import os
import signal
import subprocess
import sys
import tempfile
from collections.abc import Sequence
from pathlib import Path

from kubernetes_asyncio import config as kube_config
from pydantic import ValidationError

from tandem import logs
from tandem_dev.devcluster.cluster import ClusterStartError, DevCluster
from tandem_dev.devcluster.config import DevClusterConfig, MissingBinariesError
from tandem_dev.devcluster.podnet import foreign_interfaces
from tandem_dev.devcluster.podrunner import PodRunner, SimulateRule

OWN_NAMESPACE_ENV = "TANDEM_DEV_CLUSTER_NETNS"


def _parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(
        prog="tandem dev-cluster",
        description="Start etcd, kube-apiserver, kube-controller-manager, kube-scheduler and kwok with fake GPU "
        "nodes on 127.0.0.1, and a pod runner that serves `tandem sim` on simulated SGLang pods' IPs.",
    )
    p.add_argument("--nodes", type=int, default=8, help="fake GPU nodes (default 8)")
    p.add_argument("--gpus-per-node", type=int, default=8, help="nvidia.com/gpu per node (default 8)")
    p.add_argument("--nodes-per-block", type=int, default=4, help="nodes per topology.tandem.dev/block (default 4)")
    p.add_argument("--pod-cidr", default="127.10.0.0/16", help="pod IPs (127/8, on the cluster's pod bridge)")
    p.add_argument("--dir", type=Path, help="state directory (default: a new temporary directory)")
    p.add_argument(
        "--no-pod-runner",
        action="store_true",
        help="do not run `tandem sim` behind SGLang pods (kwok then marks pods Ready without probes)",
    )
    p.add_argument("--sglang-image", default="sglang", help="image substring that marks a pod as SGLang")
    return p


async def _serve(cluster: DevCluster, run_pods: bool, rule: SimulateRule) -> None:
    stop = asyncio.Event()
    loop = asyncio.get_running_loop()
    for sig in (signal.SIGINT, signal.SIGTERM):
        loop.add_signal_handler(sig, stop.set)
    if not run_pods:
        await stop.wait()
        return
    api = await kube_config.new_client_from_config(config_file=str(cluster.kubeconfig))
    try:
        runner = PodRunner(api, cluster.layout.logs / "pods", rule, network=cluster.pod_network)
        async with runner.running_in_background():
            await stop.wait()
    finally:
        await api.close()


def _in_own_namespace(argv: Sequence[str]) -> None:
    """Re-exec inside a new loopback-only network namespace unless already in one."""
    if not foreign_interfaces():
        subprocess.run(["ip", "link", "set", "lo", "up"], check=True)
        return
    if os.environ.get(OWN_NAMESPACE_ENV):
        raise SystemExit("tandem dev-cluster: the new network namespace still has other interfaces")
    unshare = ["unshare", *(["--map-root-user"] if os.getuid() != 0 else []), "--net", "--"]
    os.environ[OWN_NAMESPACE_ENV] = "1"
    os.execvp("unshare", [*unshare, sys.executable, "-m", "tandem.cli", "dev-cluster", *argv])


def _enter_hint() -> str:
    """The nsenter command that joins this namespace (and the user namespace, when ``unshare`` mapped root)."""
    initial_user_ns = Path("/proc/self/uid_map").read_text().split() == ["0", "0", "4294967295"]
    return f"nsenter --target {os.getpid()} --net{'' if initial_user_ns else ' --user --preserve-credentials'}"


def main(argv: Sequence[str]) -> int:
    args = _parser().parse_args(list(argv))
    try:
        config = DevClusterConfig(
            nodes=args.nodes,
            gpus_per_node=args.gpus_per_node,
            nodes_per_block=args.nodes_per_block,
            pod_cidr=args.pod_cidr,
            kwok_marks_ready=args.no_pod_runner,  # nothing would run the pods' probes
        )
    except ValidationError as err:
        print(f"tandem dev-cluster: invalid option: {err}", file=sys.stderr)
        return 2
    _in_own_namespace(argv)
    logs.setup(component="tandem_dev.devcluster")
    root = args.dir or Path(tempfile.mkdtemp(prefix="tandem-dev-cluster-"))
    try:
        cluster = DevCluster(root, config).start()
    except (MissingBinariesError, ClusterStartError) as err:
        print(f"tandem dev-cluster: {err}", file=sys.stderr)
        return 1
    try:
        print(f"dev cluster ready in {cluster.timings['total']:.1f}s: {config.nodes} nodes at {cluster.server}")
        print(f"  it runs in a network namespace of its own; enter it with: {_enter_hint()} bash")
        print(f"  export KUBECONFIG={cluster.kubeconfig}")
        print(f"  binaries (kubectl, helm): {cluster.bin_dir}")
        print(f"  logs: {cluster.layout.logs}")
        print("Ctrl-C stops it.", flush=True)
        asyncio.run(_serve(cluster, not args.no_pod_runner, SimulateRule(image_substring=args.sglang_image)))
    finally:
        cluster.stop()
    return 0
