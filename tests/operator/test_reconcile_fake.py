"""Reconcile passes end to end: pools, group pods with epochs, registration, gang recovery, scaling.

Uses a real etcd for the registry and ``FakeKube`` for the API server (the real control plane is not on this
branch yet; see fake_kube.py for what it does and does not do). Passes are run one by one for determinism.
"""

from __future__ import annotations

from collections.abc import AsyncIterator
from typing import Any

import pytest

from tandem import registry
from tandem.registry import Role
from tandem.registry_etcd import client as etcd_client
from tandem_operator.fencing import GroupKey
from tandem_operator.reconcile import reconcile_once
from tandem_operator.registrar import Registrar
from tandem_operator.runtime import ClusterRuntime, RuntimeOptions
from tests.operator.conftest import kimi_spec
from tests.operator.fake_kube import FakeKube
from tests.operator.workers import CLUSTER

SPEC = kimi_spec(transfer={"protocol": "tcp"})  # prefill: 2 groups x 1 node; decode: 1 group x 2 nodes
PREFIX = registry.cluster_prefix("serving", "kimi")
POOLS = "/apis/tandem.dev/v1alpha1/namespaces/serving/pdpools"


@pytest.fixture
async def runtime(etcd_endpoint: str) -> AsyncIterator[ClusterRuntime]:
    etcd = etcd_client([etcd_endpoint])
    await etcd.connect()
    await etcd.delete_prefix(registry.ROOT.encode())
    await etcd.close()
    registrar = Registrar([etcd_endpoint], ttl=5)
    await registrar.start()
    kube = FakeKube()
    kube.objects["/apis/tandem.dev/v1alpha1/namespaces/serving/pdclusters/kimi"] = {
        "metadata": {"name": "kimi", "namespace": "serving", "uid": CLUSTER.uid}
    }
    rt = ClusterRuntime(CLUSTER, SPEC, kube, registrar, RuntimeOptions("test"), frozenset)
    rt.generation = 1
    yield rt
    await rt.stop(unregister=True)
    await registrar.close()


def kube_of(rt: ClusterRuntime) -> FakeKube:
    assert isinstance(rt.kube, FakeKube)
    return rt.kube


def epochs(kube: FakeKube) -> dict[str, str]:
    return {name: pod["metadata"]["annotations"]["tandem.dev/epoch"] for name, pod in kube.pods().items()}


async def run_all(rt: ClusterRuntime) -> None:
    kube = kube_of(rt)
    for n, name in enumerate(sorted(kube.pods())):
        await rt.on_pod_event("MODIFIED", kube.run_pod(name, f"10.0.0.{n + 1}"))


async def registered(rt: ClusterRuntime) -> dict[str, int]:
    listing = await rt.registrar.list_endpoints("serving", "kimi")
    return {key.name: endpoint.epoch for key, endpoint in listing.items()}


def cluster_status(kube: FakeKube) -> dict[str, Any]:
    status: dict[str, Any] = kube.objects["/apis/tandem.dev/v1alpha1/namespaces/serving/pdclusters/kimi"]["status"]
    return status


async def test_create_register_recover_and_scale(runtime: ClusterRuntime) -> None:
    kube = kube_of(runtime)
    await reconcile_once(runtime)
    assert kube.objects[f"{POOLS}/kimi-decode"]["spec"]["replicas"] == 1
    assert kube.objects[f"{POOLS}/kimi-prefill"]["spec"]["replicas"] == 2
    assert epochs(kube) == {
        "kimi-prefill-0-0": "0",
        "kimi-prefill-1-0": "0",
        "kimi-decode-0-0": "0",
        "kimi-decode-0-1": "0",
    }
    assert cluster_status(kube)["phase"] == "Pending"  # observed before the pods were created
    assert await registered(runtime) == {}

    await run_all(runtime)
    await reconcile_once(runtime)
    assert await registered(runtime) == {"prefill-0": 0, "prefill-1": 0, "decode-0": 0}
    status = cluster_status(kube)
    assert (status["phase"], status["decode"]["readyGroups"], status["prefill"]["readyGroups"]) == ("Ready", 1, 2)
    assert kube.objects[f"{POOLS}/kimi-decode"]["status"]["readyReplicas"] == 1

    # A decode follower is deleted: the fast path fences the group at once.
    dead = kube.objects.pop("/api/v1/namespaces/serving/pods/kimi-decode-0-1")
    fence = await runtime.on_pod_event("DELETED", dead)
    assert fence is not None
    assert fence.group == GroupKey(Role.DECODE, 0)
    assert await registered(runtime) == {"prefill-0": 0, "prefill-1": 0}
    # The reconcile bumps the Service's epoch and deletes the rest of the group (gang semantics) ...
    await reconcile_once(runtime)
    service = kube.objects["/api/v1/namespaces/serving/services/kimi-decode-0"]
    assert service["metadata"]["annotations"]["tandem.dev/epoch"] == "1"
    assert "kimi-decode-0-0" not in kube.pods()
    assert cluster_status(kube)["phase"] == "Degraded"
    # ... then recreates it as epoch 1, and registers it when Ready: one recovery.
    await reconcile_once(runtime)
    assert epochs(kube)["kimi-decode-0-0"] == epochs(kube)["kimi-decode-0-1"] == "1"
    await run_all(runtime)
    await reconcile_once(runtime)
    assert await registered(runtime) == {"prefill-0": 0, "prefill-1": 0, "decode-0": 1}
    status = cluster_status(kube)
    assert (status["phase"], status["recoveries"]) == ("Ready", 1)
    assert status["lastRecoverySeconds"] >= 0
    reasons = [e["reason"] for e in kube.events]
    for reason in ("Fenced", "StaleMetadataRemoved", "GroupRecreating", "Registered", "GroupReady"):
        assert reason in reasons

    # kubectl scale pdpool/kimi-decode --replicas=2, then back to 1.
    kube.objects[f"{POOLS}/kimi-decode"]["spec"]["replicas"] = 2
    await reconcile_once(runtime)
    assert {"kimi-decode-1-0", "kimi-decode-1-1"} <= set(kube.pods())
    await run_all(runtime)
    await reconcile_once(runtime)
    assert (await registered(runtime))["decode-1"] == 0
    kube.objects[f"{POOLS}/kimi-decode"]["spec"]["replicas"] = 1
    await reconcile_once(runtime)
    assert "decode-1" not in await registered(runtime)
    assert not {"kimi-decode-1-0", "kimi-decode-1-1"} & set(kube.pods())
    assert "/api/v1/namespaces/serving/services/kimi-decode-1" not in kube.objects
    assert cluster_status(kube)["recoveries"] == 1  # a scale-down is not a recovery


async def test_a_restarted_operator_adopts_registrations_without_new_pods(runtime: ClusterRuntime) -> None:
    kube = kube_of(runtime)
    await reconcile_once(runtime)
    await run_all(runtime)
    await reconcile_once(runtime)
    before = dict(kube.pods())
    # A new operator process: fresh runtime and registrar, same cluster state and etcd.
    registrar = Registrar(runtime.registrar.endpoints, ttl=5)
    await registrar.start()
    successor = ClusterRuntime(CLUSTER, SPEC, kube, registrar, RuntimeOptions("test-2"), frozenset)
    successor.adopted = await registrar.list_endpoints("serving", "kimi")
    try:
        await reconcile_once(successor)
        assert kube.pods() == before
        assert await registered(successor) == {"prefill-0": 0, "prefill-1": 0, "decode-0": 0}
        # Re-put under the successor's lease: they outlive the first operator's lease.
        leases = {kv.lease for kv in await registrar._client.get_prefix(PREFIX.encode())}
        assert leases == {registrar._lease.id}
    finally:
        await registrar.close()
