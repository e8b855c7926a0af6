"""Which nodes hold the staged weights, and which to label as holding them. Pure.

A worker pod's prefetch init container (``model.weightCache.prefetch``) exits 0 only once the node's copy is
complete (its completion marker names the repo and revision). The operator then labels the node
``naming.staged_label(spec)=staged``, and worker pods prefer labelled nodes (``recipe.cached_weights_affinity``): a
recreated or added group lands where its load is a local read, not a download. The label is one per staged copy
(repo, revision, node directory), so nodes keep the labels of other revisions and models; the PDCluster's
``status.weights`` counts the nodes holding this one.

With ``weightCache.stageNodes`` the weights are staged ahead of any worker: a Job per node of
``weightCache.nodeLabel`` that holds neither the label nor a Job (``desired.staging_jobs``); the node is labelled
once its Job succeeded, and ``status.weights`` counts the nodes, the Jobs running and the Jobs failed.
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping
from dataclasses import dataclass
from enum import StrEnum
from typing import Any

from tandem_operator.api.pdcluster import PDClusterSpec
from tandem_operator.api.recipe import WeightsStatus
from tandem_operator.decide.observe import Pod, staged_nodes
from tandem_operator.desired.naming import ANNOTATION_STAGED_NODE, STAGED_LABEL_PREFIX, STAGED_VALUE, staged_label


def node_staged_labels(node: Mapping[str, Any]) -> frozenset[str]:
    """The staged-weights labels (``weights.tandem.dev/<digest>=staged``) a Node object carries."""
    labels = (node.get("metadata") or {}).get("labels") or {}
    return frozenset(k for k, v in labels.items() if k.startswith(STAGED_LABEL_PREFIX) and v == STAGED_VALUE)


class JobState(StrEnum):
    ACTIVE = "Active"
    SUCCEEDED = "Succeeded"
    FAILED = "Failed"  # backoffLimit or activeDeadlineSeconds reached: left for the user to look at and delete


def job_state(job: Mapping[str, Any]) -> tuple[str, JobState]:
    """The node a staging Job stages (``desired.staging_jobs``; "" if unannotated) and how far it is."""
    node = str(((job.get("metadata") or {}).get("annotations") or {}).get(ANNOTATION_STAGED_NODE, ""))
    status = job.get("status") or {}
    conditions = {c.get("type"): c.get("status") for c in status.get("conditions") or ()}
    if conditions.get("Complete") == "True" or int(status.get("succeeded") or 0) > 0:
        return node, JobState.SUCCEEDED
    if conditions.get("Failed") == "True":
        return node, JobState.FAILED
    return node, JobState.ACTIVE


@dataclass(frozen=True)
class Staging:
    label: str  # the node label of this cluster's copy
    to_label: frozenset[str]  # nodes a prefetch or a staging Job finished on that do not carry it yet
    create_jobs: frozenset[str]  # weightCache.stageNodes: nodes to stage, with neither the label nor a Job
    status: WeightsStatus


def staging(
    spec: PDClusterSpec,
    pods: Iterable[Pod],
    node_labels: Mapping[str, frozenset[str]],
    node_keys: Mapping[str, frozenset[str]] | None = None,
    jobs: Iterable[Mapping[str, Any]] = (),
) -> Staging | None:
    """The nodes to label, the staging Jobs to create and the weights status; None without
    ``model.weightCache.prefetch`` (nothing is staged by the operator).

    ``node_labels``: each node's staged labels (``node_staged_labels``); ``node_keys``: each node's label keys,
    which say the nodes of ``weightCache.nodeLabel`` that ``stageNodes`` stages (None: not known yet, no Job is
    created); ``jobs``: the cluster's staging Jobs.
    """
    label, cache = staged_label(spec), spec.model.weight_cache
    if label is None or cache is None:
        return None
    holding = frozenset(node for node, labels in node_labels.items() if label in labels)
    done = set(staged_nodes(pods))
    create: frozenset[str] = frozenset()
    progress: dict[str, int] = {}
    if cache.stage_nodes and node_keys is not None:
        disk = frozenset(node for node, keys in node_keys.items() if cache.node_label in keys)
        states = dict(job_state(job) for job in jobs)
        done |= {node for node, state in states.items() if state is JobState.SUCCEEDED}
        create = disk - holding - done - states.keys()
        waiting = [states[node] for node in disk - holding if node in states]
        progress = {
            "nodes": len(disk),
            "staging_nodes": waiting.count(JobState.ACTIVE),
            "failed_nodes": waiting.count(JobState.FAILED),
        }
    revision = f"{cache.repo}@{spec.model.revision or 'default'}"
    status = WeightsStatus(revision=revision, node_label=label, staged_nodes=len(holding), **progress)
    return Staging(label, frozenset(done - holding), create, status)
