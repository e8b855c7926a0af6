"""Staging as its own workload (issue #35 item 1, ``model.weightCache.stageNodes``): one Job per node of
``weightCache.nodeLabel`` not yet holding the weights, the node labelled once its Job succeeded, the progress in
``status.weights``. Pure, plus reconcile passes against a fake Kube."""

from __future__ import annotations

from typing import Any

import pytest
from pydantic import ValidationError

from tandem.registry import Role
from tandem_operator.act.k8s.apply import object_path
from tandem_operator.api.pdcluster import PDClusterSpec
from tandem_operator.decide.staging import JobState, job_state, staging
from tandem_operator.desired.naming import compat_revision, staged_label
from tandem_operator.desired.staging_jobs import staging_job_name, staging_jobs
from tandem_operator.run.runtime import ClusterRuntime, RuntimeOptions
from tests.operator.conftest import kimi_spec, role_hash
from tests.operator.fakes import FakeKube, FakeRegistrar, with_pools
from tests.operator.workers import CLUSTER

SHA = "0123456789abcdef0123456789abcdef01234567"
DISK = "example.com/weight-disk"
CACHE = {"hostPath": "/mnt/nvme/models", "repo": "moonshotai/Kimi-K2.6", "nodeLabel": DISK, "stageNodes": True}


def spec(**cache: Any) -> PDClusterSpec:
    model = {"path": "/models/Kimi-K2.6", "revision": SHA, "weightCache": {**CACHE, **cache}}
    return kimi_spec(transfer={"protocol": "tcp"}, model=model, prefill={"groups": 0}, decode={"groups": 0})


@pytest.mark.parametrize("cache", [{"nodeLabel": None}, {"prefetch": False}])
def test_staging_needs_the_disk_label_and_the_prefetch(cache: dict[str, Any]) -> None:
    with pytest.raises(ValidationError, match=r"weightCache\.stageNodes stages the weights"):
        spec(**cache)


def test_a_job_runs_the_workers_prefetch_pinned_to_its_node() -> None:
    node = "gpu-" + "n" * 250
    (job,) = staging_jobs(CLUSTER, spec(), [node])
    assert job["metadata"]["name"] == staging_job_name(CLUSTER.name, node)
    assert len(job["metadata"]["name"]) <= 63
    assert job["metadata"]["annotations"] == {"tandem.dev/node": node}
    assert job["metadata"]["labels"]["tandem.dev/cluster"] == CLUSTER.name
    assert job["metadata"]["ownerReferences"][0]["kind"] == "PDCluster"
    assert job["spec"]["activeDeadlineSeconds"] == spec().lifecycle.weight_download_deadline_seconds
    pod = job["spec"]["template"]
    assert "tandem.dev/cluster" not in pod["metadata"]["labels"]  # no worker: the pod watch leaves it alone
    assert pod["spec"]["nodeName"] == node
    assert pod["spec"]["restartPolicy"] == "Never"
    (container,) = pod["spec"]["containers"]
    assert container["name"] == "prefetch-weights"
    assert container["command"][-4:] == ["moonshotai/Kimi-K2.6", "/models/Kimi-K2.6", SHA, ".tandem-complete"]
    assert pod["spec"]["volumes"] == [
        {"name": "weights", "hostPath": {"path": "/mnt/nvme/models", "type": "Directory"}}
    ]
    assert staging_jobs(CLUSTER, spec(), []) == []


def _job(node: str, status: dict[str, Any]) -> dict[str, Any]:
    (job,) = staging_jobs(CLUSTER, spec(), [node])
    return {**job, "status": status}


def test_a_job_per_disk_node_not_yet_staged_and_the_progress_counted() -> None:
    s = spec()
    label = staged_label(s)
    assert label is not None
    disk = frozenset({DISK, "kubernetes.io/hostname"})
    keys = {f"n{i}": disk for i in range(1, 7)} | {"cpu-1": frozenset({"kubernetes.io/hostname"})}
    labels = {"n1": frozenset({label})}
    jobs = [
        _job("n2", {"active": 1}),
        _job("n3", {"failed": 7, "conditions": [{"type": "Failed", "status": "True"}]}),
        _job("n5", {"succeeded": 1, "conditions": [{"type": "Complete", "status": "True"}]}),
        _job("n1", {"succeeded": 1}),  # labelled already
    ]
    states = [JobState.ACTIVE, JobState.FAILED, JobState.SUCCEEDED, JobState.SUCCEEDED]
    assert [job_state(j) for j in jobs] == list(zip(["n2", "n3", "n5", "n1"], states, strict=True))
    plan = staging(s, [], labels, keys, jobs)
    assert plan is not None
    assert plan.create_jobs == {"n4", "n6"}  # neither labelled nor a Job; cpu-1 has no weight disk
    assert plan.to_label == {"n5"}  # its Job succeeded
    assert plan.status.to_wire() == {
        "revision": f"moonshotai/Kimi-K2.6@{SHA}",
        "nodeLabel": label,
        "stagedNodes": 1,
        "nodes": 6,
        "stagingNodes": 1,
        "failedNodes": 1,
    }
    unknown = staging(s, [], labels, None, jobs)  # the node watch has not reported yet: no Job
    assert unknown is not None
    assert unknown.create_jobs == frozenset()
    assert "nodes" not in unknown.status.to_wire()


async def test_the_reconcile_creates_the_jobs_then_labels_the_nodes_they_staged() -> None:
    s = spec()
    label = staged_label(s)
    kube, registrar = FakeKube(), FakeRegistrar()
    runtime = ClusterRuntime(CLUSTER, s, kube, registrar, RuntimeOptions("test"), dict)
    with_pools(kube, CLUSTER, s)
    staged = runtime.reconciler.staged
    for name, labels in (("gpu-1", {DISK: ""}), ("gpu-2", {DISK: ""}), ("cpu-1", {})):
        staged.observe("ADDED", {"metadata": {"name": name, "labels": labels}})

    await runtime.reconciler.reconcile_once()
    created = [c[2] for c in kube.verbs("apply") if c[2]["kind"] == "Job"]
    assert sorted(j["spec"]["template"]["spec"]["nodeName"] for j in created) == ["gpu-1", "gpu-2"]
    [status] = [c[2]["status"] for c in kube.verbs("apply") if c[2]["kind"] == "PDCluster"]
    weights = status["weights"]
    assert (weights["nodes"], weights["stagingNodes"], weights["stagedNodes"]) == (2, 2, 0)

    for job in created:  # as the API server returns them: gpu-1's done, gpu-2's still running
        node = job["spec"]["template"]["spec"]["nodeName"]
        kube.objects[object_path(job)] = {**job, "status": {"succeeded": 1} if node == "gpu-1" else {"active": 1}}
    kube.calls.clear()
    await runtime.reconciler.reconcile_once()
    assert [c[1:] for c in kube.verbs("patch") if "/nodes/" in c[1]] == [
        ("/api/v1/nodes/gpu-1", {"metadata": {"labels": {label: "staged"}}})
    ]
    assert [c for c in kube.verbs("apply") if c[2]["kind"] == "Job"] == []  # each node has its Job
    [status] = [c[2]["status"] for c in kube.verbs("apply") if c[2]["kind"] == "PDCluster"]
    assert (status["weights"]["stagedNodes"], status["weights"]["stagingNodes"]) == (1, 1)


def test_staging_rolls_no_pod() -> None:
    on, off = spec(), spec(stageNodes=False)
    assert compat_revision(on) == compat_revision(off)
    assert all(role_hash(on, role) == role_hash(off, role) for role in Role)
