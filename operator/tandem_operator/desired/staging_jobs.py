"""The staging Jobs of ``model.weightCache.stageNodes``: one per node labelled ``weightCache.nodeLabel`` that does not
hold the weights yet, running the worker pods' own prefetch container there. Pure.

The container, its env (the Hugging Face token), requests and the weights volume are taken from a rendered decode
pod, so a Job stages exactly what a worker would. ``nodeName`` pins the pod to its node past the scheduler (a GPU
node's NoSchedule taints do not keep it off; the decode role's tolerations are copied for NoExecute ones).
``restartPolicy: Never`` with the Job's default backoff retries a failed download in a new pod (resuming the partial
copy); ``activeDeadlineSeconds`` is ``lifecycle.weightDownloadDeadlineSeconds``, and the TTL controller deletes a
finished Job after ``FINISHED_TTL_S`` (the node is labelled by then: ``decide.staging``). A worker prefetching on
the same node at the same time writes the same copy: ``snapshot_download`` locks each file it downloads into a
``local_dir`` (huggingface_hub 0.23+: ``.cache/huggingface/download/<file>.lock``), and the completion marker is
replaced atomically.
"""

from __future__ import annotations

import hashlib
from collections.abc import Collection
from typing import Any

from tandem.registry import Role
from tandem_operator.api.pdcluster import PDClusterSpec
from tandem_operator.desired.naming import (
    ANNOTATION_STAGED_NODE,
    FIELD_MANAGER,
    LABEL_CLUSTER,
    LABEL_COMPONENT,
    STAGING_COMPONENT,
    ClusterRef,
    cluster_owner,
)
from tandem_operator.desired.pods import RoleContext, group_pod

FINISHED_TTL_S = 3600
MAX_NAME = 63  # a Job's name is its pods' job-name label value
_CLUSTER_PREFIX = MAX_NAME - len("-stage-") - 10


def staging_job_name(cluster: str, node: str) -> str:
    return f"{cluster[:_CLUSTER_PREFIX]}-stage-{hashlib.sha256(node.encode()).hexdigest()[:10]}"


def staging_jobs(ref: ClusterRef, spec: PDClusterSpec, nodes: Collection[str]) -> list[dict[str, Any]]:
    """The Job manifests that stage the weights on ``nodes``."""
    if not nodes:
        return []
    owner = cluster_owner(ref)
    pod = group_pod(RoleContext.build(ref, spec, Role.DECODE, owner), 0, 0)["spec"]
    (prefetch,) = pod["initContainers"]
    template_spec: dict[str, Any] = {
        "restartPolicy": "Never",
        "enableServiceLinks": False,
        "securityContext": pod["securityContext"],
        "containers": [prefetch],
        "volumes": [v for v in pod["volumes"] if v["name"] == "weights"],
    }
    for key in ("imagePullSecrets", "tolerations"):
        if key in pod:
            template_spec[key] = pod[key]
    pod_labels = {"app.kubernetes.io/managed-by": FIELD_MANAGER, LABEL_COMPONENT: STAGING_COMPONENT}  # no worker
    labels = {**pod_labels, LABEL_CLUSTER: ref.name}
    return [
        {
            "apiVersion": "batch/v1",
            "kind": "Job",
            "metadata": {
                "name": staging_job_name(ref.name, node),
                "namespace": ref.namespace,
                "labels": labels,
                "annotations": {ANNOTATION_STAGED_NODE: node},
                "ownerReferences": [owner.to_manifest()],
            },
            "spec": {
                "activeDeadlineSeconds": spec.lifecycle.weight_download_deadline_seconds,
                "ttlSecondsAfterFinished": FINISHED_TTL_S,
                "template": {
                    "metadata": {"labels": pod_labels},
                    "spec": {**template_spec, "nodeName": node},
                },
            },
        }
        for node in sorted(nodes)
    ]
