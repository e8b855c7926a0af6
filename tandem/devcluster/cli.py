"""``tandem dev-cluster``: run the real test control plane with fake GPU nodes until interrupted."""

from __future__ import annotations

import argparse
import asyncio
import signal
import sys
import tempfile
from collections.abc import Sequence
from pathlib import Path

from kubernetes_asyncio import config as kube_config
from pydantic import ValidationError

from tandem import logs
from tandem.devcluster.cluster import ClusterStartError, DevCluster
from tandem.devcluster.config import DevClusterConfig, MissingBinariesError
from tandem.devcluster.podrunner import PodRunner, SimulateRule


def _parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(
        prog="tandem dev-cluster",
        description="Start etcd, kube-apiserver, kube-controller-manager, kube-scheduler and kwok with fake GPU "
        "nodes on 127.0.0.1, and a pod runner that serves `tandem sim` on simulated SGLang pods' IPs.",
    )
    p.add_argument("--nodes", type=int, default=8, help="fake GPU nodes (default 8)")
    p.add_argument("--gpus-per-node", type=int, default=8, help="nvidia.com/gpu per node (default 8)")
    p.add_argument("--nodes-per-block", type=int, default=4, help="nodes per topology.tandem.dev/block (default 4)")
    p.add_argument("--pod-cidr", default="127.10.0.0/16", help="loopback range for pod IPs")
    p.add_argument("--dir", type=Path, help="state directory (default: a new temporary directory)")
    p.add_argument("--no-pod-runner", action="store_true", help="do not run `tandem sim` behind SGLang pods")
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
        async with PodRunner(api, cluster.layout.logs / "pods", rule).running_in_background():
            await stop.wait()
    finally:
        await api.close()


def main(argv: Sequence[str]) -> int:
    args = _parser().parse_args(list(argv))
    try:
        config = DevClusterConfig(
            nodes=args.nodes,
            gpus_per_node=args.gpus_per_node,
            nodes_per_block=args.nodes_per_block,
            pod_cidr=args.pod_cidr,
        )
    except ValidationError as err:
        print(f"tandem dev-cluster: invalid option: {err}", file=sys.stderr)
        return 2
    logs.setup(component="tandem.devcluster")
    root = args.dir or Path(tempfile.mkdtemp(prefix="tandem-dev-cluster-"))
    try:
        cluster = DevCluster(root, config).start()
    except (MissingBinariesError, ClusterStartError) as err:
        print(f"tandem dev-cluster: {err}", file=sys.stderr)
        return 1
    try:
        print(f"dev cluster ready in {cluster.timings['total']:.1f}s: {config.nodes} nodes at {cluster.server}")
        print(f"  export KUBECONFIG={cluster.kubeconfig}")
        print(f"  binaries (kubectl, helm): {cluster.bin_dir}")
        print(f"  logs: {cluster.layout.logs}")
        print("Ctrl-C stops it.", flush=True)
        asyncio.run(_serve(cluster, not args.no_pod_runner, SimulateRule(image_substring=args.sglang_image)))
    finally:
        cluster.stop()
    return 0
