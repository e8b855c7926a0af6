"""A NotReady node (issue #34): out of routing at once, fenced only after ``lifecycle.nodeLostGraceSeconds``.

The runtime and its reconcile pass run against a fake Kube and registrar (tests/operator/fakes.py); every worker pod
sits on a node of its own. The node outages are what the operator's node handler hands each runtime
(``fencing.node_outage`` of the Node events); the grace is the spec's.
"""

from __future__ import annotations

import asyncio
import contextlib
import time
from datetime import UTC, datetime, timedelta
from typing import Any

import pydantic
import pytest

from tandem.registry import Role
from tandem_operator.act.k8s.apply import object_path
from tandem_operator.api.lifecycle import LifecycleSpec
from tandem_operator.api.pdcluster import PDClusterSpec
from tandem_operator.decide.fencing import NodeOutage
from tandem_operator.decide.observe import GroupKey
from tandem_operator.desired.naming import ClusterRef
from tandem_operator.run.render import InvalidClusterError, render
from tandem_operator.run.runtime import ClusterRuntime, RuntimeOptions
from tests.operator.conftest import kimi_spec, role_hash
from tests.operator.fakes import FakeKube, FakeRegistrar, with_pools
from tests.operator.workers import CLUSTER, live_pod
from tests.tandem_dev.devcluster.devcluster_fixtures import eventually

SPEC = kimi_spec(transfer={"protocol": "tcp"})
DECODE_0 = GroupKey(Role.DECODE, 0)
NODE = "gpu-decode-0-1"  # the node of decode-0's rank 1
GROUPS = ["decode-0", "prefill-0", "prefill-1"]


def _node(role: Role, group: int, rank: int) -> str:
    return f"gpu-{role.value}-{group}-{rank}"


def _cluster(
    spec: PDClusterSpec = SPEC, options: RuntimeOptions | None = None
) -> tuple[ClusterRuntime, FakeKube, FakeRegistrar, dict[str, NodeOutage]]:
    kube, registrar, outages = FakeKube(), FakeRegistrar(), dict[str, NodeOutage]()
    ref = ClusterRef(CLUSTER.name, CLUSTER.namespace, CLUSTER.uid)
    with_pools(kube, ref, spec)
    for role in Role:
        for group in range(spec.role(role).groups):
            for rank in range(spec.role(role).nodes_per_group):
                ip = f"10.0.{group}.{rank + (10 if role is Role.DECODE else 0)}"
                pod = live_pod(spec, role, group, rank, ip=ip, node=_node(role, group, rank))
                kube.objects[object_path(pod)] = pod
    runtime = ClusterRuntime(ref, spec, kube, registrar, options or RuntimeOptions("test"), lambda: outages)
    return runtime, kube, registrar, outages


def _notready(seconds_ago: float) -> NodeOutage:
    return NodeOutage(gone=False, since=datetime.now(UTC) - timedelta(seconds=seconds_ago))


def _deleted_decode_0_pods(kube: FakeKube) -> list[tuple[str, str, Any]]:
    return [c for c in kube.verbs("delete") if "/pods/kimi-decode-0-" in c[1]]


async def _event_reasons(kube: FakeKube) -> list[str]:
    await asyncio.sleep(0.05)  # Events are posted in the background
    return [c[2]["reason"] for c in kube.verbs("post")]


async def test_a_node_notready_within_the_grace_unroutes_and_the_same_epoch_comes_back() -> None:
    runtime, kube, registrar, outages = _cluster()
    await runtime.reconciler.reconcile_once()
    assert sorted(registrar.entries) == GROUPS
    kube.calls.clear()

    outages[NODE] = _notready(40)  # a kubelet-lease blip: the node controller says Unknown; the pods look Ready
    await runtime.on_nodes_changed({NODE})
    assert "decode-0" not in registrar.entries  # out of routing at once
    assert runtime.state.fenced == {}  # no fence, no recreation
    await runtime.reconciler.reconcile_once()
    assert "decode-0" not in registrar.entries  # the pass does not register it while its node is NotReady
    assert sorted(registrar.entries) == ["prefill-0", "prefill-1"]

    del outages[NODE]  # Ready again within the grace
    await runtime.on_nodes_changed({NODE})
    await runtime.reconciler.reconcile_once()
    assert registrar.entries["decode-0"].epoch == 0  # the same incarnation
    assert kube.verbs("delete", "create") == []  # no pod deleted or created
    reasons = await _event_reasons(kube)
    assert "Fenced" not in reasons
    [unrouted] = [c[2]["note"] for c in kube.verbs("post") if c[2]["reason"] == "Unrouted"]
    assert f"node {NODE} is NotReady" in unrouted
    assert "300 s" in unrouted


async def test_a_node_notready_past_the_grace_fences_and_recreates_its_groups() -> None:
    runtime, kube, registrar, outages = _cluster()
    await runtime.reconciler.reconcile_once()
    outages[NODE] = _notready(301)  # the default grace is 300 s
    await runtime.on_nodes_changed({NODE})
    assert runtime.state.fenced[DECODE_0].reason == "NodeLost"
    assert "decode-0" not in registrar.entries
    await runtime.reconciler.reconcile_once()
    deleted = _deleted_decode_0_pods(kube)
    assert len(deleted) == SPEC.decode.nodes_per_group
    assert {c[2] for c in deleted} == {0}  # grace 0: NCCL cannot lose a rank
    stamped = [c[2] for c in kube.verbs("apply") if c[1] == "kimi-decode-0"]
    assert stamped[-1]["metadata"]["annotations"]["tandem.dev/epoch"] == "1"
    assert sorted(registrar.entries) == ["prefill-0", "prefill-1"]  # the other groups are untouched


@pytest.mark.parametrize(
    ("gone", "pod_event", "reason"),
    [
        (True, None, "NodeLost"),  # the node object is deleted
        (False, "DELETED", "PodDeleted"),  # NotReady 10 s ago: the data path confirms death within the grace
        (False, "Failed", "PodFailed"),
        (False, "restarted", "ContainerRestarted"),
    ],
)
async def test_a_deleted_node_or_a_dead_member_fences_at_once(gone: bool, pod_event: str | None, reason: str) -> None:
    runtime, _kube, registrar, outages = _cluster()
    await runtime.reconciler.reconcile_once()
    # Taken now, not at collection: under xdist a test may run minutes after it was collected, past the grace.
    outages[NODE] = NodeOutage(gone=True, since=datetime.now(UTC)) if gone else _notready(10)
    await runtime.on_nodes_changed({NODE})
    if pod_event is not None:
        assert runtime.state.fenced == {}
        pod = dict(runtime.state.pods["kimi-decode-0-1"])
        if pod_event == "Failed":
            pod["status"] = {**pod["status"], "phase": "Failed"}
        elif pod_event == "restarted":
            pod["status"] = {**pod["status"], "containerStatuses": [{"restartCount": 1, "state": {"running": {}}}]}
        await runtime.on_pod_event("DELETED" if pod_event == "DELETED" else "MODIFIED", pod)
    assert runtime.state.fenced[DECODE_0].reason == reason
    assert "decode-0" not in registrar.entries


@pytest.mark.parametrize(("notready_s", "fenced"), [(301, True), (100, False)])
async def test_a_restarted_operator_counts_the_grace_from_the_nodes_condition(notready_s: float, fenced: bool) -> None:
    """A fresh runtime (an operator started while the node is NotReady) gets the outage from the Node's Ready
    ``lastTransitionTime``: its first pass fences a group whose node is down past the grace, before any event,
    and leaves one within the grace unregistered."""
    runtime, kube, registrar, outages = _cluster()
    outages[NODE] = _notready(notready_s)
    await runtime.reconciler.reconcile_once()
    assert (DECODE_0 in runtime.state.fenced) is fenced
    assert len(_deleted_decode_0_pods(kube)) == (SPEC.decode.nodes_per_group if fenced else 0)
    assert sorted(registrar.entries) == ["prefill-0", "prefill-1"]


async def test_the_grace_timer_fences_a_node_that_stays_notready_without_another_event() -> None:
    """No pod or node event and no periodic resync (60 s) within the test: the timer set for the grace does it."""
    spec = kimi_spec(transfer={"protocol": "tcp"}, lifecycle={"nodeLostGraceSeconds": 1})
    runtime, kube, registrar, outages = _cluster(spec, RuntimeOptions("test", resync_seconds=60))
    loop = asyncio.create_task(runtime._loop())  # the reconcile loop alone (start() would also watch etcd)
    runtime.kick()
    try:
        await asyncio.wait_for(runtime.reconciled.wait(), 10)
        assert sorted(registrar.entries) == GROUPS
        outages[NODE] = _notready(0)
        began = time.monotonic()
        await runtime.on_nodes_changed({NODE})
        assert "decode-0" not in registrar.entries
        assert runtime.state.fenced == {}

        async def deleted() -> bool:
            return bool(_deleted_decode_0_pods(kube))

        await eventually(deleted, "decode-0's pods deleted once the grace ran out", within=10)
        assert time.monotonic() - began >= 1.0  # not before the grace ran out
        assert runtime.state.fenced[DECODE_0].reason == "NodeLost"
    finally:
        loop.cancel()
        with contextlib.suppress(asyncio.CancelledError):
            await loop
        await runtime.stop(unregister=False)


def test_the_grace_is_validated_and_changes_no_pod() -> None:
    assert LifecycleSpec().node_lost_grace_seconds == 300  # Kubernetes' own not-ready/unreachable toleration
    assert LifecycleSpec.model_validate({"nodeLostGraceSeconds": 0}).node_lost_grace_seconds == 0
    with pytest.raises(pydantic.ValidationError, match="greater than or equal to 0"):
        LifecycleSpec.model_validate({"nodeLostGraceSeconds": -1})
    doc = {
        "apiVersion": "tandem.dev/v1alpha1",
        "kind": "PDCluster",
        "metadata": {"name": "kimi"},
        "spec": {**SPEC.to_wire(), "lifecycle": {"nodeLostGraceSeconds": -1}},
    }
    with pytest.raises(InvalidClusterError) as err:
        render(doc)
    assert err.value.messages == [
        "spec.lifecycle.nodeLostGraceSeconds: Invalid value: -1: spec.lifecycle.nodeLostGraceSeconds in body should "
        "be greater than or equal to 0"
    ]
    # The grace is the operator's own timer: changing it (or upgrading to an operator that has it) rolls no pod.
    for role in Role:
        short = kimi_spec(transfer={"protocol": "tcp"}, lifecycle={"nodeLostGraceSeconds": 30})
        assert role_hash(short, role) == role_hash(SPEC, role)
        longer = kimi_spec(transfer={"protocol": "tcp"}, lifecycle={"drainTimeoutSeconds": 30})
        assert role_hash(longer, role) != role_hash(SPEC, role)  # the rest of lifecycle still rolls
