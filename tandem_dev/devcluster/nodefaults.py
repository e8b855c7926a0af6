"""Node faults on the dev cluster: a node's kubelet that stops reaching the API server, and comes back.

kwok plays every node's kubelet for the node itself: it renews the node's Lease (``kube-node-lease/<node>``) and
writes the node's status only while it holds that Lease (sigs.k8s.io/kwok v0.7.0, ``NodeLeaseController``: a Lease
held by another identity and not expired makes the node read-only to kwok, which tries again every renewal
interval). ``cut_kubelet`` hands the Lease to another identity for an hour without renewing it, so nothing renews
it any more: kube-controller-manager's node lifecycle controller, after its ``--node-monitor-grace-period`` (50 s
here, as on Kubernetes >= 1.32) without a renewal, sets the node's Ready condition Unknown ("Kubelet stopped posting
node status"), taints it ``node.kubernetes.io/unreachable`` (NoSchedule and NoExecute) and marks its pods NotReady,
as on a cluster whose kubelet lost the API server (a lease blip, a partition, a dead machine). The pods' processes
keep running (the pod runner's sandboxes): only the control plane lost the node.

``restore_kubelet`` gives the Lease back: kwok takes it at its next try (within ~10 s), reports the node Ready and
the node controller lifts the taints. The pods' Ready conditions are the kubelet's to put back: the pod runner's
``resync(node)`` does what a kubelet's status sync does once it reaches the API server again.
"""

from __future__ import annotations

from typing import Any

from kubernetes_asyncio import client

from tandem_dev.devcluster.cluster import node_ready

LEASE_NAMESPACE = "kube-node-lease"
CUT_HOLDER = "tandem-dev-kubelet-cut"  # not kwok's identity: kwok leaves the node alone while this holds the Lease
CUT_LEASE_SECONDS = 3600  # kwok takes a Lease back once it expired; this one does not within any test


async def cut_kubelet(api: client.ApiClient, node: str) -> None:
    """Stop ``node``'s kubelet (kwok) renewing its Lease and posting its status. The renew time is left as it is:
    the node controller counts its grace from the last renewal."""
    patch = {"spec": {"holderIdentity": CUT_HOLDER, "leaseDurationSeconds": CUT_LEASE_SECONDS}}
    await client.CoordinationV1Api(api).patch_namespaced_lease(node, LEASE_NAMESPACE, patch)


async def restore_kubelet(api: client.ApiClient, node: str) -> None:
    """Let kwok hold ``node``'s Lease again (it renews it and reports the node Ready at its next try)."""
    patch = {"spec": {"holderIdentity": None}}
    await client.CoordinationV1Api(api).patch_namespaced_lease(node, LEASE_NAMESPACE, patch)


async def read_node(api: client.ApiClient, node: str) -> dict[str, Any]:
    found = await client.CoreV1Api(api).read_node(node)
    data: dict[str, Any] = api.sanitize_for_serialization(found)
    return data


def ready_condition(node: dict[str, Any]) -> dict[str, Any] | None:
    """The node's Ready condition (status True, False or Unknown; ``lastTransitionTime``), if it has one."""
    conditions = (node.get("status") or {}).get("conditions") or ()
    return next((c for c in conditions if c.get("type") == "Ready"), None)


async def not_ready(api: client.ApiClient, node: str) -> dict[str, Any] | None:
    """``node``'s Ready condition once it is not True, else None (poll it with ``eventually``)."""
    condition = ready_condition(await read_node(api, node))
    return condition if condition is not None and condition.get("status") != "True" else None


async def schedulable(api: client.ApiClient, node: str) -> bool:
    """``node`` is Ready and the node controller lifted its NoSchedule/NoExecute taints."""
    return node_ready(await read_node(api, node))
