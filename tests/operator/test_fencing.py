"""Which group a pod or node event fences, and which Mooncake keys are stale (pure, plain equality)."""

from __future__ import annotations

from collections.abc import Collection
from datetime import UTC, datetime, timedelta
from typing import Any

import pytest

from tandem.registry import Role
from tandem_operator.decide.fencing import (
    Fence,
    FenceReason,
    NodeOutage,
    NodeVerdicts,
    StaleKeys,
    death_reason,
    fence_decision,
    node_outage,
    node_verdicts,
    pod_event,
    stale_mooncake_keys,
    unroute_decision,
)
from tandem_operator.decide.observe import (
    KEPT_ENV,
    GroupKey,
    PodHealth,
    created_at,
    pod_facts,
    pod_health,
    slim_pod,
    started,
)
from tests.operator.conftest import kimi_spec
from tests.operator.workers import live_pod

SPEC = kimi_spec(transfer={"protocol": "tcp"})
DECODE_0 = GroupKey(Role.DECODE, 0)


def decide(event: str, pod: dict[str, Any], lost_nodes: Collection[str] = (), **kwargs: Any) -> Fence | None:
    args: dict[str, Any] = {"fenced": {}, "retiring": ()}
    return fence_decision(pod_event(event, pod, lost_nodes), **{**args, **kwargs})


def test_pod_facts_of_a_worker_pod() -> None:
    facts = pod_facts(live_pod(SPEC, Role.DECODE, 0, 1, epoch=3, ip="10.1.2.3"))
    assert facts is not None
    assert (facts.cluster, facts.group, facts.rank, facts.epoch, facts.ip) == ("kimi", DECODE_0, 1, 3, "10.1.2.3")
    # tcp, 8 ranks per pod with decode KV offload: two engines per rank (PD, Store), an RPC and a data port each, in
    # the window of epoch 3 (the last of the range's two)
    assert (facts.mooncake_ports, facts.mooncake_rpc_port) == (tuple(range(15132, 15164)), None)
    assert facts.env["MC_METADATA_CLUSTER_ID"] == "serving.kimi"


def test_pod_facts_ignores_other_pods() -> None:
    assert pod_facts({"metadata": {"name": "x", "labels": {"app": "web"}}}) is None
    assert pod_facts({"metadata": {"labels": {"tandem.dev/role": "decode", "tandem.dev/cluster": "k"}}}) is None


def _dead(how: str) -> dict[str, Any]:
    pod = live_pod(SPEC, Role.DECODE, 0, 1)
    if how == "terminating":
        pod["metadata"]["deletionTimestamp"] = "2026-01-01T00:00:00Z"
    elif how == "failed":
        pod["status"]["phase"] = "Failed"
    elif how == "restarted":
        pod["status"]["containerStatuses"] = [{"name": "sglang", "restartCount": 1, "state": {"running": {}}}]
    elif how == "notready":
        pod["status"]["conditions"] = [{"type": "Ready", "status": "False"}]
    return pod


@pytest.mark.parametrize(
    ("event", "how", "reason"),
    [
        ("DELETED", "alive", FenceReason.POD_DELETED),
        ("MODIFIED", "terminating", FenceReason.POD_TERMINATING),
        ("MODIFIED", "failed", FenceReason.POD_FAILED),
        ("MODIFIED", "restarted", FenceReason.CONTAINER_RESTARTED),
    ],
)
def test_a_dead_member_fences_its_group(event: str, how: str, reason: FenceReason) -> None:
    pod = live_pod(SPEC, Role.DECODE, 0, 1) if how == "alive" else _dead(how)
    name = "kimi-decode-0-1"
    assert decide(event, pod) == Fence(DECODE_0, 0, reason, name)


def test_a_member_on_a_lost_node_fences_its_group() -> None:
    pod = live_pod(SPEC, Role.DECODE, 0, 1, node="gpu-7")
    assert decide("MODIFIED", pod, lost_nodes={"gpu-7"}) == Fence(DECODE_0, 0, FenceReason.NODE_LOST, "kimi-decode-0-1")
    assert decide("MODIFIED", pod, lost_nodes={"gpu-8"}) is None


def test_healthy_starting_or_notready_pods_fence_nothing() -> None:
    assert decide("MODIFIED", live_pod(SPEC, Role.DECODE, 0, 1)) is None
    assert decide("MODIFIED", _dead("notready")) is None  # readiness only gates routing


def test_a_notready_member_of_a_registered_group_only_unroutes_it() -> None:
    def unroute(pod: dict[str, Any], registered: dict[GroupKey, int]) -> GroupKey | None:
        return unroute_decision(pod_event("MODIFIED", pod, ()), registered=registered)

    assert unroute(_dead("notready"), {DECODE_0: 0}) == DECODE_0
    assert unroute(live_pod(SPEC, Role.DECODE, 0, 1), {DECODE_0: 0}) is None  # Ready
    assert unroute(_dead("notready"), {}) is None  # never registered: still starting
    assert unroute(_dead("notready"), {DECODE_0: 1}) is None  # an older incarnation than the registered one
    assert unroute(_dead("failed"), {DECODE_0: 0}) is None  # dead: fenced, not unrouted


def test_one_fence_per_incarnation_and_none_for_retiring_groups() -> None:
    assert decide("DELETED", live_pod(SPEC, Role.DECODE, 0, 0), fenced={DECODE_0: 0}) is None
    assert decide("DELETED", live_pod(SPEC, Role.DECODE, 0, 0, epoch=1), fenced={DECODE_0: 0}) is not None
    assert decide("DELETED", live_pod(SPEC, Role.DECODE, 0, 0), retiring={DECODE_0}) is None


NOW = datetime(2026, 1, 1, 12, 0, tzinfo=UTC)
A_MINUTE_AGO = NOW - timedelta(seconds=60)


def _node(ready: str | None, changed: str | None = "2026-01-01T11:59:00Z", **metadata: str) -> dict[str, Any]:
    """A Node whose Ready condition is ``ready`` (None: no Ready condition yet) since ``changed``."""
    condition = {"type": "Ready", "status": ready, **({"lastTransitionTime": changed} if changed else {})}
    return {"metadata": {"name": "n", **metadata}, "status": {"conditions": [condition] if ready else []}}


@pytest.mark.parametrize(
    ("event", "node", "outage"),
    [
        ("MODIFIED", _node("True"), None),
        ("ADDED", _node(None), None),  # registering: no Ready condition yet
        ("MODIFIED", _node("False"), NodeOutage(gone=False, since=A_MINUTE_AGO)),  # the kubelet says NotReady
        ("MODIFIED", _node("Unknown"), NodeOutage(gone=False, since=A_MINUTE_AGO)),  # the node controller does
        # An operator started while the node is down (kopf's initial listing: no event type) counts the time the
        # node was down before it started, from the condition, not from now.
        ("None", _node("Unknown", "2026-01-01T11:50:00Z"), NodeOutage(False, NOW - timedelta(minutes=10))),
        ("MODIFIED", _node("Unknown", None), NodeOutage(gone=False, since=NOW)),  # no stamp: from now
        ("MODIFIED", _node("Unknown", "2026-01-01T12:05:00Z"), NodeOutage(gone=False, since=NOW)),  # clock skew
        ("MODIFIED", _node("Unknown", "yesterday"), NodeOutage(gone=False, since=NOW)),
        ("DELETED", _node("True"), NodeOutage(gone=True, since=NOW)),
        ("MODIFIED", _node("True", deletionTimestamp="2026-01-01T12:00:00Z"), NodeOutage(gone=True, since=NOW)),
    ],
)
def test_node_outage(event: str, node: dict[str, Any], outage: NodeOutage | None) -> None:
    assert node_outage(event, node, NOW, None) == outage


def test_a_node_outage_counts_from_its_first_notready() -> None:
    """The node controller restamps the transition False -> Unknown; the outage began at the first one."""
    first = node_outage("MODIFIED", _node("False", "2026-01-01T11:59:00Z"), NOW, None)
    assert first == NodeOutage(gone=False, since=A_MINUTE_AGO)
    assert node_outage("MODIFIED", _node("Unknown", "2026-01-01T11:59:40Z"), NOW, first) == first
    assert node_outage("DELETED", _node("Unknown"), NOW, first) == NodeOutage(gone=True, since=A_MINUTE_AGO)
    assert node_outage("MODIFIED", _node("True"), NOW, first) is None  # Ready again: the outage is over


def test_node_verdicts_weigh_each_outage_against_the_grace() -> None:
    outages = {
        "blip": NodeOutage(gone=False, since=A_MINUTE_AGO),
        "almost": NodeOutage(gone=False, since=NOW - timedelta(seconds=250)),
        "down": NodeOutage(gone=False, since=NOW - timedelta(seconds=300)),
        "deleted": NodeOutage(gone=True, since=NOW),
    }
    assert node_verdicts(outages, 300, NOW) == NodeVerdicts(
        lost=frozenset({"down", "deleted"}), unreachable=frozenset({"blip", "almost"}), next_check_s=50.0
    )
    assert node_verdicts(outages, 0, NOW).lost == set(outages)  # grace 0: every NotReady node at once
    assert node_verdicts({}, 300, NOW) == NodeVerdicts(frozenset(), frozenset(), None)


def test_a_member_on_an_unreachable_node_unroutes_its_group_and_fences_nothing() -> None:
    pod = live_pod(SPEC, Role.DECODE, 0, 1, node="gpu-7")  # its own Ready condition still True

    def unroute(pod: dict[str, Any], unreachable: set[str], lost: set[str] | None = None) -> GroupKey | None:
        event = pod_event("MODIFIED", pod, lost or set())
        return unroute_decision(event, registered={DECODE_0: 0}, unreachable_nodes=unreachable)

    assert unroute(pod, {"gpu-7"}) == DECODE_0
    assert unroute(pod, {"gpu-8"}) is None
    assert decide("MODIFIED", pod) is None  # NotReady within the grace is no death
    assert pod_health(pod, unreachable_nodes=frozenset({"gpu-7"})) is PodHealth.STARTING  # not registered again
    assert unroute(pod, set(), lost={"gpu-7"}) is None  # past the grace: fenced, not unrouted
    # The data path confirms a death at once, whatever the node's grace: the pod gone, Failed, restarted.
    failed = _dead("failed")
    failed["spec"]["nodeName"] = "gpu-7"
    assert decide("MODIFIED", failed) == Fence(DECODE_0, 0, FenceReason.POD_FAILED, "kimi-decode-0-1")
    assert decide("DELETED", pod) == Fence(DECODE_0, 0, FenceReason.POD_DELETED, "kimi-decode-0-1")


def test_stale_keys_cover_every_member_by_ip_and_ip_port() -> None:
    members = [pod_facts(live_pod(SPEC, Role.DECODE, 0, r, ip=f"10.0.0.{r + 5}")) for r in range(2)]
    stale = stale_mooncake_keys([m for m in members if m is not None], "unused")
    assert stale == StaleKeys(
        keys=(
            "mooncake/serving.kimi/ram/10.0.0.5",
            "mooncake/serving.kimi/ram/10.0.0.6",
            "mooncake/serving.kimi/rpc_meta/10.0.0.5",
            "mooncake/serving.kimi/rpc_meta/10.0.0.6",
        ),
        prefixes=(
            "mooncake/serving.kimi/ram/10.0.0.5:",
            "mooncake/serving.kimi/ram/10.0.0.6:",
            "mooncake/serving.kimi/rpc_meta/10.0.0.5:",
            "mooncake/serving.kimi/rpc_meta/10.0.0.6:",
        ),
    )


def test_stale_keys_of_host_network_pods_name_only_their_own_ports() -> None:
    """Every rank of the pod may hold any port of the pod's range (8 ranks x 2 ports with tcp)."""
    spec = kimi_spec(transfer={"protocol": "tcp", "hostNetwork": True})
    facts = pod_facts(live_pod(spec, Role.PREFILL, 0, 0, ip="192.168.1.4"))
    assert facts is not None
    assert stale_mooncake_keys([facts], "x") == StaleKeys(
        keys=tuple(
            f"mooncake/serving.kimi/{kind}/192.168.1.4:{port}"
            for kind in ("ram", "rpc_meta")
            for port in range(15000, 15016)
        ),
        prefixes=(),
    )


def test_stale_keys_skip_pods_without_ip_and_honour_a_cluster_id_override() -> None:
    pod = live_pod(SPEC, Role.DECODE, 0, 0, ip=None)
    facts = pod_facts(pod)
    assert facts is not None
    assert stale_mooncake_keys([facts], "d") == StaleKeys((), ())
    pod = live_pod(SPEC, Role.DECODE, 0, 0, ip="10.0.0.9")
    pod["spec"]["containers"][0]["env"] = [{"name": "MC_METADATA_CLUSTER_ID", "value": ""}]
    facts = pod_facts(pod)
    assert facts is not None
    assert stale_mooncake_keys([facts], "d").keys == ("mooncake/ram/10.0.0.9", "mooncake/rpc_meta/10.0.0.9")


def test_a_slim_pod_keeps_every_fact_the_deciders_read() -> None:
    pod = live_pod(SPEC, Role.DECODE, 3, 1, epoch=2, ip="10.0.0.7", node="n1")
    pod["metadata"]["managedFields"] = [{"manager": "x", "fieldsV1": {"f:spec": {}}}]
    pod["metadata"].setdefault("annotations", {})["kubectl.kubernetes.io/last-applied-configuration"] = "{...}"
    pod["metadata"]["creationTimestamp"] = "2026-01-01T00:00:00Z"
    pod["status"]["containerStatuses"] = [{"restartCount": 1, "started": True, "state": {"running": {}}, "image": "i"}]
    slim = slim_pod(pod)
    assert "managedFields" not in slim["metadata"]
    assert list(slim["metadata"]["annotations"]) == [
        k for k in pod["metadata"]["annotations"] if k.startswith("tandem")
    ]
    assert pod_facts(slim) == pod_facts(pod)
    assert pod_health(slim, frozenset({"n2"})) == pod_health(pod, frozenset({"n2"}))
    assert (started(slim), created_at(slim)) == (started(pod), created_at(pod))
    pod["metadata"]["deletionTimestamp"] = "2026-01-01T00:00:01Z"
    assert death_reason("MODIFIED", slim_pod(pod), ()) is death_reason("MODIFIED", pod, ()) is not None
    assert {e["name"] for e in slim["spec"]["containers"][0]["env"]} <= KEPT_ENV
    assert [c["type"] for c in slim["status"]["conditions"]] == ["Ready"]
    del pod["metadata"]["deletionTimestamp"]
    pod["status"]["containerStatuses"] = [{"restartCount": 0, "state": {"terminated": {"exitCode": 1}}}]
    assert pod_health(pod) is pod_health(slim_pod(pod)) is PodHealth.DEAD
