"""Staged nodes labelled on the dev cluster (issue #35 item 1): real kube-apiserver and kube-controller-manager
(the Job controller), the operator, kwok's kubelet, which reports every init container terminated with exit code 0
and completes the pods of Jobs (``tandem_dev/devcluster/kwok-stages.yaml``).

Once a worker pod's prefetch finished on a node, the node carries the operator's ``weights.tandem.dev/<digest>``
label and the PDCluster's ``status.weights`` counts it; with ``weightCache.stageNodes`` and no worker at all, one
Job per node of ``weightCache.nodeLabel`` stages it. The labels are removed again at the end (nodes are shared).
"""

from __future__ import annotations

from typing import Any

import pytest
from kubernetes_asyncio import client

from tests.operator.live import SIM_SPEC, Live, create_pdcluster, operator_process, pdc_status, pdcluster, pods
from tests.tandem_dev.devcluster.devcluster_fixtures import eventually

pytestmark = [pytest.mark.k8s, pytest.mark.timeout(120)]
ONE_NODE = {"nodesPerGroup": 1, "tpSize": 1}
MODEL = {
    **SIM_SPEC["model"],
    "path": "/models/kimi-k2.6-sim",
    "weightCache": {"hostPath": "/var/lib/tandem-test/weights", "repo": "sim/kimi-k2.6-sim"},
}


async def test_nodes_a_prefetch_finished_on_are_labelled_and_counted(live: Live) -> None:
    ns, api = live.ns, live.api
    live.procs.append(operator_process(live.cluster, ns, live.etcd, live.tmp, "op-staging").start())
    decode = {**SIM_SPEC["decode"], **ONE_NODE}
    await create_pdcluster(api, ns, pdcluster("sim", decode=decode, model=MODEL))
    core = client.CoreV1Api(api)

    async def staged() -> dict[str, Any] | None:
        weights = (await pdc_status(api, ns, "sim")).get("weights") or {}
        nodes = {p.spec.node_name for p in await pods(api, ns) if p.spec.node_name}
        return weights if len(nodes) == 2 and weights.get("stagedNodes") == len(nodes) else None

    weights: dict[str, Any] = {}
    try:
        weights = await eventually(staged, "both pods' nodes staged in status.weights", within=60)
        label = weights["nodeLabel"]
        assert label.startswith("weights.tandem.dev/")
        assert weights["revision"] == "sim/kimi-k2.6-sim@default"
        for pod in await pods(api, ns):
            node = await core.read_node(pod.spec.node_name)
            assert node.metadata.labels.get(label) == "staged", pod.spec.node_name
            assert any(
                term.preference.match_expressions[0].key == label
                for term in pod.spec.affinity.node_affinity.preferred_during_scheduling_ignored_during_execution
            )
    finally:
        if weights.get("nodeLabel"):
            listing = await core.list_node(label_selector=weights["nodeLabel"])
            for node in listing.items:
                await core.patch_node(node.metadata.name, {"metadata": {"labels": {weights["nodeLabel"]: None}}})


SHA = "0123456789abcdef0123456789abcdef01234567"
NO_GROUPS = {"groups": 0}


async def test_staging_jobs_stage_the_disk_nodes_before_any_worker(live: Live) -> None:
    ns, api = live.ns, live.api
    core = client.CoreV1Api(api)
    disk = f"disk.tandem.dev/{ns}"[:63]
    names = sorted(n.metadata.name for n in (await core.list_node()).items if n.metadata.name.startswith("gpu-"))[:2]
    assert len(names) == 2, names
    for name in names:
        await core.patch_node(name, {"metadata": {"labels": {disk: "true"}}})
    live.procs.append(operator_process(live.cluster, ns, live.etcd, live.tmp, "op-stage-jobs").start())
    cache = {**MODEL["weightCache"], "nodeLabel": disk, "stageNodes": True}
    prefill, decode = {**SIM_SPEC["prefill"], **NO_GROUPS}, {**SIM_SPEC["decode"], **NO_GROUPS}
    model = {**MODEL, "revision": SHA, "weightCache": cache}
    await create_pdcluster(api, ns, pdcluster("sim", prefill=prefill, decode=decode, model=model))

    async def staged() -> dict[str, Any] | None:
        weights = (await pdc_status(api, ns, "sim")).get("weights") or {}
        return weights if weights.get("nodes") == 2 and weights.get("stagedNodes") == 2 else None

    weights: dict[str, Any] = {}
    try:
        weights = await eventually(staged, "both disk nodes staged by their Jobs", within=60)
        assert (weights["stagingNodes"], weights["failedNodes"]) == (0, 0)
        jobs = await client.BatchV1Api(api).list_namespaced_job(ns)
        assert sorted(j.spec.template.spec.node_name for j in jobs.items) == names
        assert all(j.status.succeeded == 1 for j in jobs.items)
        assert await pods(api, ns) == []  # no worker: the Jobs staged the nodes
        for name in names:
            assert (await core.read_node(name)).metadata.labels.get(weights["nodeLabel"]) == "staged"
    finally:
        drop = {disk: None, **({weights["nodeLabel"]: None} if weights.get("nodeLabel") else {})}
        for name in names:
            await core.patch_node(name, {"metadata": {"labels": drop}})
