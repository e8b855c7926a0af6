"""``tandem operator`` as a process against the dev cluster, for its live tests and the dev-cluster chaos run."""

from __future__ import annotations

import sys
from pathlib import Path

from kubernetes_asyncio import client
from kubernetes_asyncio.client.exceptions import ApiException

from tandem_dev.procs import ManagedProcess

LEASE = "tandem-operator"  # the operator's default --leader-election-name


def operator_process(
    kubeconfig: Path,
    namespace: str,
    etcd: str,
    log_dir: Path,
    identity: str,
    *,
    leader_election: bool = False,
    resync_s: float | None = None,
) -> ManagedProcess:
    """The operator serving ``namespace`` (its Lease there too, with ``leader_election``), the registry at ``etcd``
    (comma-separated endpoint URLs); ``resync_s`` overrides the periodic reconcile. Not started."""
    argv = [sys.executable, "-m", "tandem.cli", "operator", "--kubeconfig", str(kubeconfig), "--namespace", namespace]
    argv += ["--etcd-endpoints", etcd, "--identity", identity]
    argv += [] if resync_s is None else ["--resync", f"{resync_s:g}"]
    argv += ["--leader-election-namespace", namespace] if leader_election else ["--no-leader-election"]
    return ManagedProcess(f"operator-{identity}", argv, log_dir / f"operator-{identity}.log")


async def lease_holder(api: client.ApiClient, namespace: str) -> str | None:
    """Who holds the operator's Lease in ``namespace`` (None: no Lease yet, or no holder)."""
    try:
        lease = await client.CoordinationV1Api(api).read_namespaced_lease(LEASE, namespace)
    except ApiException as err:
        if err.status == 404:
            return None
        raise
    holder: str | None = lease.spec.holder_identity
    return holder
