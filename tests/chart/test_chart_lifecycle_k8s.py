"""`helm install` / `helm test` / `helm upgrade` / `helm uninstall` of charts/tandem on the real test control plane.

The release is installed with deploy/values-sim.yaml. kwok pods run no containers, so the chart's operator and
router run as local processes from the argv of the chart's own Deployments (tests/chart/stack.py), the operator
authenticated as the chart's ServiceAccount (a TokenRequest token): every API call it makes is authorized by the
chart's ClusterRole. deploy/sim-small.yaml becomes Ready (``tandem sim`` behind its pods' IPs) and serves the
official ``openai`` SDK through the router. ``helm test`` cannot run its pod here (no containers), so the test
runs that pod's own script (read back from the release's hooks) against the local router instead.
"""

from __future__ import annotations

import asyncio
import json
import sys
import time
from pathlib import Path

import pytest
import yaml
from kubernetes_asyncio import client
from openai import AsyncOpenAI

from tandem_dev.devcluster.cluster import DevCluster
from tandem_dev.procs import ManagedProcess
from tandem_operator.run.main import parse_args
from tests.chart.monitoring import exercise_and_query
from tests.chart.stack import (
    CHART,
    DEPLOY,
    LocalDeployment,
    ServiceLoad,
    cluster_objects_of_release,
    namespace_objects,
    operator_args,
    pdcluster_manifest,
    pod_runner,
    router_args,
    service_account_kubeconfig,
    start_etcd,
    tool,
)
from tests.tandem_dev.devcluster.devcluster_fixtures import eventually

pytestmark = [pytest.mark.k8s, pytest.mark.netns, pytest.mark.timeout(300)]

RELEASE = "tandem"
MODEL = "kimi-k2.6-sim"
PDCLUSTERS = ("tandem.dev", "v1alpha1", "pdclusters")
OPERATOR_DEFAULTS = parse_args([])
CLUSTER_PODS = "tandem.dev/cluster=sim"


async def _pdcluster_ready(api: client.ApiClient, namespace: str) -> bool:
    custom = client.CustomObjectsApi(api)
    obj = await custom.get_namespaced_custom_object("tandem.dev", "v1alpha1", namespace, "pdclusters", "sim")
    conditions = (obj.get("status") or {}).get("conditions") or []
    return any(c["type"] == "Ready" and c["status"] == "True" for c in conditions)


async def _complete(base: str) -> str:
    async with AsyncOpenAI(base_url=f"{base}/v1", api_key="none", max_retries=0, timeout=30) as sdk:
        out = await sdk.completions.create(model=MODEL, prompt="The capital of France is", max_tokens=8)
    assert out.usage is not None
    assert out.usage.completion_tokens > 0
    return out.choices[0].text


async def _serves(base: str) -> bool:
    try:
        await _complete(base)
    except Exception:
        return False
    return True


async def _helm_test_script(cluster: DevCluster, namespace: str, router_url: str) -> str:
    """The helm-test pod's script, pointed at the local router instead of the in-cluster Service."""
    hooks = [d for d in yaml.safe_load_all(await tool(cluster, "helm", "get", "hooks", RELEASE, "-n", namespace)) if d]
    (pod,) = [d for d in hooks if d["metadata"]["annotations"].get("helm.sh/hook") == "test"]
    (container,) = pod["spec"]["containers"]
    assert container["command"] == ["python3", "-c"]
    script: str = container["args"][0]
    in_cluster = f"http://{RELEASE}-router.{namespace}.svc:8000"
    assert in_cluster in script
    return script.replace(in_cluster, router_url)


async def _run_script(script: str) -> str:
    proc = await asyncio.create_subprocess_exec(
        sys.executable, "-c", script, stdout=asyncio.subprocess.PIPE, stderr=asyncio.subprocess.STDOUT
    )
    async with asyncio.timeout(60):
        out, _ = await proc.communicate()
    assert proc.returncode == 0, out.decode()
    return out.decode()


async def _roll(
    deployment: LocalDeployment, args: list[str], port_flag: str, endpoints: list[str] | None, pre_stop_s: float = 0
) -> None:
    """A rolling update of one replica (maxSurge 1, maxUnavailable 0): the new one is Ready and in the Service's
    endpoints before the old one leaves them; the old one runs its preStop sleep, then gets SIGTERM (and drains)."""
    old, old_url = deployment.current, deployment.url
    assert old is not None
    ready = "/readiness" if endpoints is not None else "/healthz"
    new_url = await asyncio.to_thread(deployment.start, args, port_flag, (), ready)
    if endpoints is not None:
        endpoints.append(new_url)
        endpoints.remove(old_url)
    await asyncio.sleep(pre_stop_s)
    await asyncio.to_thread(old.stop, 30)


async def _router_pre_stop_seconds(api: client.ApiClient, namespace: str) -> int:
    dep = await client.AppsV1Api(api).read_namespaced_deployment(f"{RELEASE}-router", namespace)
    (container,) = dep.spec.template.spec.containers
    assert container.lifecycle
    assert container.lifecycle.pre_stop
    assert container.lifecycle.pre_stop.sleep
    return int(container.lifecycle.pre_stop.sleep.seconds)


async def test_install_serve_upgrade_uninstall(
    k8s_cluster: DevCluster, k8s_api: client.ApiClient, k8s_namespace: str, tmp_path: Path
) -> None:
    ns, timings = k8s_namespace, {}
    procs: list[ManagedProcess] = []
    try:
        etcd = start_etcd(tmp_path, procs)
        began = time.monotonic()
        values = ["-f", str(DEPLOY / "values-sim.yaml"), "--set", f"etcd.endpoints={{{etcd}}}"]
        notes = await tool(k8s_cluster, "helm", "install", RELEASE, str(CHART), "-n", ns, *values, "--timeout", "60s")
        assert "kubectl -n" in notes
        assert "port-forward svc/tandem-router 8000:8000" in notes
        timings["helm install"] = time.monotonic() - began

        kubeconfig = await service_account_kubeconfig(k8s_cluster, k8s_api, ns, f"{RELEASE}-operator")
        operator = LocalDeployment("operator", tmp_path, procs, env={"POD_NAMESPACE": ns})
        op_args = await operator_args(k8s_api, ns, RELEASE, kubeconfig)
        assert f"--etcd-endpoints={etcd}" in op_args
        assert "--log-level=info" in op_args
        await asyncio.to_thread(operator.start, op_args, "--metrics-port", (), "/healthz")
        router = LocalDeployment("router", tmp_path, procs)
        r_args = await router_args(k8s_api, ns, RELEASE)
        assert "--policy=cache_aware" in r_args
        assert "--cluster-name=sim" in r_args
        await asyncio.to_thread(router.start, r_args, "--port")

        async with pod_runner(k8s_api, ns, tmp_path / "pods") as runner:
            began = time.monotonic()
            custom = client.CustomObjectsApi(k8s_api)
            await custom.create_namespaced_custom_object(
                *PDCLUSTERS[:2], ns, PDCLUSTERS[2], pdcluster_manifest(ns, etcd)
            )
            await eventually(lambda: _pdcluster_ready(k8s_api, ns), "PDCluster sim Ready", within=90)
            await eventually(lambda: _serves(router.url), "a completion through the router", within=60)
            timings["PDCluster to first completion"] = time.monotonic() - began
            print(f"openai SDK through the router: {await _complete(router.url)!r}")
            print(await _run_script(await _helm_test_script(k8s_cluster, ns, router.url)))

            timings |= await exercise_and_query(
                tmp_path, procs, k8s_api, ns, runner, router.url, operator.url, MODEL, lambda: _serves(router.url)
            )

            # helm upgrade: new router policy and operator log level, rolled out under a bounded request loop.
            began = time.monotonic()
            upgrade = ["--reuse-values", "--set", "router.policy=round_robin", "--set", "operator.logLevel=debug"]
            await tool(k8s_cluster, "helm", "upgrade", RELEASE, str(CHART), "-n", ns, *upgrade)
            new_router = await router_args(k8s_api, ns, RELEASE)
            assert "--policy=round_robin" in new_router
            new_operator = await operator_args(k8s_api, ns, RELEASE, kubeconfig)
            assert "--log-level=debug" in new_operator
            endpoints = [router.url]
            load = ServiceLoad(MODEL, endpoints)
            loop = asyncio.create_task(load.run())
            await asyncio.sleep(1)
            old_router = router.url
            await _roll(router, new_router, "--port", endpoints, await _router_pre_stop_seconds(k8s_api, ns))
            before_operator_roll = load.ok
            await _roll(operator, new_operator, "--metrics-port", None)
            # Past the old operator's etcd lease TTL (the default the chart keeps): its registry entries must have
            # been taken over.
            await asyncio.sleep(OPERATOR_DEFAULTS.lease_ttl)
            past_ttl = load.ok
            await asyncio.sleep(3)
            load.stop.set()
            async with asyncio.timeout(60):
                await loop
            timings["helm upgrade + rollout under load"] = time.monotonic() - began
            print(f"upgrade: {load.ok} ok, {len(load.failures)} failed; per router {load.served}")
            assert load.failures == [], load.failures[:5]
            assert load.served.get(old_router, 0) > 0, load.served
            assert load.served.get(router.url, 0) > 0, load.served
            assert past_ttl > before_operator_roll, "no request served during the operator's rollout"
            assert load.ok > past_ttl, "no request served after the old operator's etcd lease expired"
            assert await _complete(router.url)

            # The user's PDCluster goes first (its pods are garbage-collected), then the release.
            await custom.delete_namespaced_custom_object(*PDCLUSTERS[:2], ns, PDCLUSTERS[2], "sim")
            await eventually(lambda: _all_terminating(k8s_api, ns), "the PDCluster's pods to be deleted", within=60)
            # kwok does not finish a graceful pod deletion by itself (no kubelet confirms it): confirm it with a
            # zero-grace delete, as a kubelet would once the containers stopped.
            await client.CoreV1Api(k8s_api).delete_collection_namespaced_pod(
                ns, label_selector=CLUSTER_PODS, grace_period_seconds=0
            )
            await eventually(lambda: _none_left(k8s_api, ns), "the PDCluster's pods to go", within=30)
        for proc in reversed(procs[1:]):
            proc.stop()

        began = time.monotonic()
        await tool(k8s_cluster, "helm", "uninstall", RELEASE, "-n", ns, "--wait", "--timeout", "60s")
        timings["helm uninstall"] = time.monotonic() - began
        # Left: the operator's leader-election Lease (documented in NOTES.txt and the chart README).
        left = await eventually(lambda: _settled(k8s_cluster, ns), "uninstall to settle", within=30)
        assert left == [("Lease", "tandem-operator")], left
        assert await cluster_objects_of_release(k8s_cluster, RELEASE) == []
        crds = json.loads(await tool(k8s_cluster, "kubectl", "get", "crd", "-o", "json"))
        assert {"pdclusters.tandem.dev", "pdpools.tandem.dev"} <= {c["metadata"]["name"] for c in crds["items"]}
    finally:
        for proc in reversed(procs):
            proc.stop()
    print("timings: " + ", ".join(f"{k} {v:.1f}s" for k, v in timings.items()))


async def _cluster_pods(api: client.ApiClient, namespace: str) -> list[client.V1Pod]:
    return list((await client.CoreV1Api(api).list_namespaced_pod(namespace, label_selector=CLUSTER_PODS)).items)


async def _all_terminating(api: client.ApiClient, namespace: str) -> bool:
    return all(pod.metadata.deletion_timestamp for pod in await _cluster_pods(api, namespace))


async def _none_left(api: client.ApiClient, namespace: str) -> bool:
    return not await _cluster_pods(api, namespace)


async def _settled(cluster: DevCluster, namespace: str) -> list[tuple[str, str]] | None:
    """What is left once the Services' endpoint objects are collected too."""
    left = await namespace_objects(cluster, namespace)
    return None if any(kind in {"Endpoints", "EndpointSlice"} for kind, _ in left) else left
