"""``PDCluster.spec.lifecycle``: how long a group may load, start and drain, and how long its node may be NotReady.

Loading a ~600 GB checkpoint takes many minutes, and SGLang's generation health check
(``sglang/srt/entrypoints/http_server.py``, ``health_generate``) answers only when the scheduler puts out a batch;
the probes built on it are in ``desired/probes.py``. These budgets keep a loading or busy group alive and bound a
stuck one.
"""

from __future__ import annotations

from pydantic import Field

from tandem_operator.api.rules import CrdModel, Rule


class LifecycleSpec(CrdModel):
    """Start-up, stuck-group and drain budgets of every worker group, and the grace of a NotReady node."""

    model_load_timeout_seconds: int = Field(
        default=3600,
        ge=60,
        le=86400,
        description="Model-load budget: the startupProbe allows this long before /health_generate first answers 200 "
        "(liveness and readiness start after it).",
    )
    start_deadline_seconds: int = Field(
        default=5400,
        ge=60,
        le=172800,
        description="A group still Starting or Incomplete (some member not started: unschedulable, pulling, "
        "loading) this long after its newest pod was created is recreated, with an Event. With "
        "model.weightCache.prefetch a member's time counts from when its prefetch init container finished (the "
        "download or the check of the node's copy), not from its creation, so a slow first download never counts "
        "against it: weightDownloadDeadlineSeconds bounds the download.",
    )
    weight_download_deadline_seconds: int = Field(
        default=21600,
        ge=600,
        le=604800,
        description="A group with a member whose weight prefetch (model.weightCache.prefetch) has started but not "
        "finished successfully this long after the member was created (a hung or crash-looping download) is "
        "recreated, with an Event (WeightDownloadDeadlineExceeded); the new pod resumes the download from the "
        "node's partial copy. The default 6 h fetches ~600 GB at ~30 MB/s; a pod not yet running its prefetch "
        "(unschedulable, pulling) stays under startDeadlineSeconds.",
    )
    drain_timeout_seconds: int = Field(
        default=600,
        ge=0,
        le=86400,
        description="Scale-down and rollouts unregister a group, then wait up to this long for its running "
        "requests and KV transfers to reach 0 before deleting its pods.",
    )
    node_lost_grace_seconds: int = Field(
        default=300,
        ge=0,
        le=86400,
        description="How long a node may stay NotReady (its Ready condition False or Unknown, counted from the "
        "condition's lastTransitionTime) before the groups with a pod on it are fenced and recreated. Until then they "
        "are only out of routing (same pods, same epoch) and are routed again when the node is Ready; a deleted node, "
        "or a member seen deleted, Failed or restarted, recreates its group at once. The default 300 s is Kubernetes' "
        "own: the not-ready and unreachable NoExecute tolerations the DefaultTolerationSeconds admission plugin gives "
        "every pod, after which the taint manager evicts the pods (a Terminating member is fenced), so a longer grace "
        "also needs the roles' tolerations. A node is reported NotReady only after kube-controller-manager's "
        "node-monitor-grace-period (40-50 s of missed kubelet leases), so a lease or API-server blip costs no reload, "
        "and a dead node about 6 min before its groups reload. 0 fences as soon as a node is NotReady.",
    )

    cel_rules = (
        Rule(
            cel="self.startDeadlineSeconds > self.modelLoadTimeoutSeconds",
            message="startDeadlineSeconds must exceed modelLoadTimeoutSeconds (a loading group is not stuck)",
            check=lambda s: s.start_deadline_seconds > s.model_load_timeout_seconds,
            field_path=".startDeadlineSeconds",
        ),
    )
