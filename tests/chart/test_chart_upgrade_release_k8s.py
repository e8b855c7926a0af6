"""Tested across versions (issue #38): the previous release, installed and serving, upgraded to this tree with
``helm upgrade`` under streaming load, following charts/tandem/README.md "Upgrading from 0.1.0".

The release (tandem_dev/releases.py ``PREVIOUS``: its tag, else its commit) is read with ``git archive`` into the
test's directory: its chart is installed with helm, and its operator and routers run as local processes (as in
test_chart_lifecycle_k8s.py: kwok pods run no containers) from its own code, with the argv of its chart's
Deployments. deploy/sim-small.yaml becomes Ready and serves. Then, under streaming load: this tree's CRDs, the
operator Deployment paused, ``helm upgrade`` to this tree's chart, the routers rolled one at a time, the operator
resumed and rolled. The release's worker pods render differently under this tree's operator (probes, preStop,
``SGLANG_HEALTH_CHECK_TIMEOUT``: tests/operator/golden/upgrade-from-previous-release.yaml), and the default
``upgradePolicy`` (Manual) holds them: same uids, no restart, ``PodsOutdated`` naming the difference. Annotating
``tandem.dev/roll=all`` then rolls both roles onto this tree's rendering, still under load. No stream fails.
"""

from __future__ import annotations

import asyncio
import functools
import time
from pathlib import Path

import pytest
import yaml
from kubernetes_asyncio import client

from tandem_dev.devcluster.cluster import DevCluster
from tandem_dev.procs import ManagedProcess
from tandem_dev.releases import PREVIOUS, export
from tandem_operator.run.main import parse_args
from tests.chart.release_upgrade import (
    StreamLoad,
    WorkerPod,
    answers,
    condition,
    release_env,
    roll,
    schema_metric,
    stored_entries,
    worker_pods,
)
from tests.chart.stack import (
    CHART,
    LocalDeployment,
    operator_args,
    pdcluster_manifest,
    pod_runner,
    router_args,
    service_account_kubeconfig,
    start_etcd,
    tool,
)
from tests.tandem_dev.devcluster.devcluster_fixtures import eventually

pytestmark = [pytest.mark.k8s, pytest.mark.netns, pytest.mark.timeout(720)]

RELEASE, MODEL, PODS = "tandem", "kimi-k2.6-sim", "tandem.dev/cluster=sim"
PDCLUSTERS = ("tandem.dev", "v1alpha1", "pdclusters")
NEW_ENV = "SGLANG_HEALTH_CHECK_TIMEOUT=45"  # what this tree's operator adds to every worker pod of the release
ROUTERS = 2  # deploy/values-sim.yaml's router.replicas
ROLES = ("prefill", "decode")
# What the condition names: tests/operator/golden/upgrade-from-previous-release.yaml, sim-small.
DIFFERENCE = (
    f"env added {NEW_ENV}",
    "container.startupProbe changed",
    "container.readinessProbe changed",
    "container.livenessProbe changed",
    "container.lifecycle changed",
)


async def _status(api: client.ApiClient, namespace: str) -> dict[str, object]:
    obj = await client.CustomObjectsApi(api).get_namespaced_custom_object(
        *PDCLUSTERS[:2], namespace, PDCLUSTERS[2], "sim"
    )
    status: dict[str, object] = obj.get("status") or {}
    return status


async def _ready(api: client.ApiClient, namespace: str) -> bool:
    return condition(await _status(api, namespace), "Ready").get("status") == "True"


async def _image(api: client.ApiClient, namespace: str, deployment: str) -> str:
    dep = await client.AppsV1Api(api).read_namespaced_deployment(deployment, namespace)
    image: str = dep.spec.template.spec.containers[0].image
    return image


async def _crds(cluster: DevCluster, crds: Path) -> None:
    await tool(cluster, "kubectl", "apply", "--server-side", "--force-conflicts", "-f", str(crds))
    await asyncio.to_thread(cluster.wait_established, ["pdclusters.tandem.dev", "pdpools.tandem.dev"])


async def test_previous_release_upgrades_under_load(
    k8s_cluster: DevCluster, k8s_api: client.ApiClient, k8s_namespace: str, tmp_path: Path
) -> None:
    ns, procs, timings = k8s_namespace, list[ManagedProcess](), dict[str, float]()
    old_tree = export(PREVIOUS, tmp_path / "release")
    old_env = release_env(old_tree)
    loop: asyncio.Task[None] | None = None
    try:
        etcd = start_etcd(tmp_path, procs)
        # A cluster running the release has its CRDs (helm install leaves CRDs that exist alone).
        await _crds(k8s_cluster, old_tree / "charts" / "tandem" / "crds")
        values = ["-f", str(old_tree / "deploy" / "values-sim.yaml"), "--set", f"etcd.endpoints={{{etcd}}}"]
        await tool(k8s_cluster, "helm", "install", RELEASE, str(old_tree / "charts" / "tandem"), "-n", ns, *values)
        assert await _image(k8s_api, ns, f"{RELEASE}-router") == f"ghcr.io/tandem-dev/tandem:{PREVIOUS.version}"

        kubeconfig = await service_account_kubeconfig(k8s_cluster, k8s_api, ns, f"{RELEASE}-operator")
        operator = LocalDeployment("operator", tmp_path, procs, env={"POD_NAMESPACE": ns, **old_env})
        await asyncio.to_thread(
            operator.start, await operator_args(k8s_api, ns, RELEASE, kubeconfig), "--metrics-port", (), "/healthz"
        )
        routers = [LocalDeployment(f"router{i}", tmp_path, procs, env=dict(old_env)) for i in range(ROUTERS)]
        for router in routers:
            # No workers yet: a router is live (/health), not ready.
            await asyncio.to_thread(router.start, await router_args(k8s_api, ns, RELEASE), "--port")

        async with pod_runner(k8s_api, ns, tmp_path / "pods"):
            custom = client.CustomObjectsApi(k8s_api)
            await custom.create_namespaced_custom_object(
                *PDCLUSTERS[:2], ns, PDCLUSTERS[2], pdcluster_manifest(ns, etcd)
            )
            await eventually(lambda: _ready(k8s_api, ns), "PDCluster sim Ready under the release", within=120)
            # The release's own code runs: its operator writes unversioned entries, its routers have no schema census.
            entries = await stored_entries(etcd, ns, "sim")
            assert len(entries) == 2, entries
            assert all("schema_version" not in e for e in entries), entries
            assert [await schema_metric(r.url) for r in routers] == [None] * ROUTERS
            before = await worker_pods(k8s_api, ns, PODS)
            assert {p.role for p in before} == {"prefill", "decode"}, before
            assert all(NEW_ENV not in p.env for p in before), before

            for url in [f"{r.url}/readiness" for r in routers]:
                await eventually(functools.partial(answers, url), f"{url} answering 200", within=60)
            endpoints = [r.url for r in routers]
            load = StreamLoad(MODEL, endpoints)
            loop = asyncio.create_task(load.run())
            await eventually(lambda: _at_least(load, 10), "streams through the release's routers", within=60)

            # charts/tandem/README.md "Upgrading from 0.1.0": CRDs; the operator held back; helm upgrade; routers
            # roll; then the operator.
            began = time.monotonic()
            await _crds(k8s_cluster, CHART / "crds")
            await tool(k8s_cluster, "kubectl", "-n", ns, "rollout", "pause", f"deployment/{RELEASE}-operator")
            await tool(k8s_cluster, "helm", "upgrade", RELEASE, str(CHART), "-n", ns, "--reuse-values")
            new_image = f"ghcr.io/tandem-dev/tandem:{_chart_version()}"
            assert await _image(k8s_api, ns, f"{RELEASE}-router") == new_image
            paused = await client.AppsV1Api(k8s_api).read_namespaced_deployment(f"{RELEASE}-operator", ns)
            assert paused.spec.paused, "helm upgrade resumed the paused operator Deployment"
            new_router_args = await router_args(k8s_api, ns, RELEASE)
            for router in routers:
                await roll(router, new_router_args, {}, endpoints, pre_stop_s=2)
            timings["routers rolled"] = time.monotonic() - began
            # This tree's routers read the release's unversioned entries as version 1 (older).
            census = [await schema_metric(r.url) or {} for r in routers]
            assert [(c.get("older"), sum(c.values())) for c in census] == [(2, 2)] * ROUTERS, census

            await tool(k8s_cluster, "kubectl", "-n", ns, "rollout", "resume", f"deployment/{RELEASE}-operator")
            new_operator_args = await operator_args(k8s_api, ns, RELEASE, kubeconfig)
            await roll(operator, new_operator_args, {"POD_NAMESPACE": ns}, None, pre_stop_s=0)
            timings["operator rolled"] = time.monotonic() - began
            await eventually(lambda: _versioned(etcd, ns), "entries re-put with schema_version 2", within=60)

            async def outdated() -> str | None:
                found = condition(await _status(k8s_api, ns), "PodsOutdated")
                message = found.get("message", "")
                named = found.get("status") == "True" and all(d in message for d in DIFFERENCE)
                return message if named and all(f"{role}: 1 group(s) held" in message for role in ROLES) else None

            held = await eventually(outdated, "PodsOutdated naming the difference for both roles", within=90)
            # One more periodic reconcile of every cluster: still nothing rolls.
            await asyncio.sleep(parse_args(new_operator_args[1:]).resync + 2)
            assert await worker_pods(k8s_api, ns, PODS) == before, "a worker pod changed after the upgrade"
            upgraded = (load.ok, load.cut_mid_stream, len(load.failed_before_first_byte))
            timings["upgrade held"] = time.monotonic() - began

            began = time.monotonic()
            await tool(k8s_cluster, "kubectl", "-n", ns, "annotate", "pdcluster/sim", "tandem.dev/roll=all")
            await eventually(lambda: _rolled(k8s_api, ns, before), "both roles rolled onto this tree", within=300)
            timings["roll"] = time.monotonic() - began
            await eventually(lambda: _settled(k8s_api, ns), "roll annotation removed", within=90)
            rolled = load.ok
            await eventually(lambda: _at_least(load, rolled + 10), "streams after the roll", within=60)
            load.stop.set()
            async with asyncio.timeout(60):
                await loop
            await _delete_pdcluster(k8s_api, ns)
    finally:
        if loop is not None and not loop.done():
            loop.cancel()
        for proc in reversed(procs):
            proc.stop()
        # Other tests install the chart (cluster-scoped RBAC of the release's name) and need this tree's CRDs.
        await tool(k8s_cluster, "helm", "uninstall", RELEASE, "-n", ns, check=False)
        await _crds(k8s_cluster, CHART / "crds")
    print(f"\nheld: {held}\nload through the upgrade (ok, cut, failed): {upgraded}; in all: {load.summary()}")
    print("timings: " + ", ".join(f"{k} {v:.1f}s" for k, v in timings.items()))
    assert load.failed_before_first_byte == [], load.failed_before_first_byte[:5]
    assert load.cut_mid_stream == 0
    assert len(load.served) == 2 * ROUTERS, load.served  # every router, the release's and this tree's, served


def _chart_version() -> str:
    version: str = yaml.safe_load((CHART / "Chart.yaml").read_text())["appVersion"]
    return version


async def _at_least(load: StreamLoad, count: int) -> bool:
    return load.ok >= count


async def _versioned(etcd: str, namespace: str) -> bool:
    entries = await stored_entries(etcd, namespace, "sim")
    return len(entries) == 2 and all(e.get("schema_version") == 2 for e in entries)


async def _rolled(api: client.ApiClient, namespace: str, before: list[WorkerPod]) -> bool:
    """Every worker pod is new, on this tree's rendering, and both roles of one compatibility revision; the
    PDCluster Ready with PodsOutdated False."""
    now = await worker_pods(api, namespace, PODS)
    roles = {role: [p for p in now if p.role == role] for role in ROLES}
    counts = {role: sum(p.role == role for p in before) for role in roles}
    fresh = not {p.uid for p in now} & {p.uid for p in before}
    shaped = all(len(roles[role]) == counts[role] for role in roles) and all(NEW_ENV in p.env for p in now)
    coherent = len({p.revision for p in now}) == 1 and all(
        len({p.template_hash for p in g}) == 1 for g in roles.values()
    )
    status = await _status(api, namespace)
    current = condition(status, "PodsOutdated").get("status") == "False" and await _ready(api, namespace)
    return fresh and shaped and coherent and current


async def _settled(api: client.ApiClient, namespace: str) -> bool:
    custom = client.CustomObjectsApi(api)
    obj = await custom.get_namespaced_custom_object(*PDCLUSTERS[:2], namespace, PDCLUSTERS[2], "sim")
    return "tandem.dev/roll" not in (obj["metadata"].get("annotations") or {})


async def _delete_pdcluster(api: client.ApiClient, namespace: str) -> None:
    """The PDCluster goes while the operator runs; kwok needs the graceful pod deletions confirmed, as a kubelet
    would once the containers stopped (test_chart_lifecycle_k8s.py)."""
    await client.CustomObjectsApi(api).delete_namespaced_custom_object(*PDCLUSTERS[:2], namespace, PDCLUSTERS[2], "sim")

    async def terminating() -> bool:
        listing = await client.CoreV1Api(api).list_namespaced_pod(namespace, label_selector=PODS)
        return all(pod.metadata.deletion_timestamp for pod in listing.items)

    await eventually(terminating, "the PDCluster's pods to be deleted", within=60)
    await client.CoreV1Api(api).delete_collection_namespaced_pod(namespace, label_selector=PODS, grace_period_seconds=0)
