"""The operator turns routers' integrity reports in etcd into the PDCluster's IntegrityDegraded condition and
PairQuarantined / PairReleased Events, on the real control plane. The report is written here the way a router
writes it (``tandem.registry`` models, the router's own lease); nothing is mocked."""

from __future__ import annotations

import asyncio
import json
import time
from collections.abc import AsyncIterator
from pathlib import Path
from typing import Any

import pytest
from kubernetes_asyncio import client

from tandem import registry
from tandem.registry import IntegrityReport, QuarantinedPair, RepeatOffender
from tandem_dev.devcluster.cluster import DevCluster
from tandem_dev.procs import ManagedProcess
from tests.operator.live import Registry, create_pdcluster, operator_process, pdc_status, pdcluster
from tests.tandem_dev.devcluster.devcluster_fixtures import eventually

pytestmark = [pytest.mark.k8s, pytest.mark.timeout(120)]

PREFILL, DECODE = "http://127.10.0.1:30000", "http://127.10.0.2:30001"
ROUTER = "router-0:4242"


@pytest.fixture
async def operator(
    k8s_cluster: DevCluster, k8s_namespace: str, tandem_crds: None, etcd_endpoint: str, tmp_path: Path
) -> AsyncIterator[ManagedProcess]:
    proc = operator_process(k8s_cluster, k8s_namespace, etcd_endpoint, tmp_path, "op-i").start()
    try:
        yield proc
    finally:
        proc.stop()


async def integrity_condition(api: client.ApiClient, namespace: str) -> dict[str, Any] | None:
    conditions = (await pdc_status(api, namespace, "sim")).get("conditions") or []
    return next((c for c in conditions if c["type"] == "IntegrityDegraded"), None)


async def event_notes(api: client.ApiClient, namespace: str, reason: str) -> list[tuple[str, str]]:
    """(type, note) of the operator's Events with ``reason`` (raw JSON: other components' Events lack eventTime)."""
    response: Any = await client.EventsV1Api(api).list_namespaced_event(namespace, _preload_content=False)
    return [
        (e["type"], e.get("note", ""))
        for e in json.loads(await response.read())["items"]
        if e.get("reportingController") == "tandem.dev/operator" and e["reason"] == reason
    ]


async def test_a_quarantined_pair_sets_the_condition_and_posts_events_until_its_router_lease_ends(
    k8s_api: client.ApiClient, k8s_namespace: str, operator: ManagedProcess, etcd_endpoint: str
) -> None:
    ns = k8s_namespace
    await create_pdcluster(k8s_api, ns, pdcluster("sim"))

    async def clean() -> bool:
        cond = await integrity_condition(k8s_api, ns)
        return cond is not None and (cond["status"], cond["message"]) == ("False", "no pair quarantined")

    await eventually(clean, "IntegrityDegraded False", within=30)
    report = IntegrityReport(
        router=ROUTER,
        quarantined=(QuarantinedPair(prefill=PREFILL, decode=DECODE, reason="prompt of another request", since_s=0.5),),
    )
    async with Registry(etcd_endpoint) as reg:
        lease = await reg.client.lease(60)
        put_at = time.monotonic()
        key = registry.integrity_key(ns, "sim", ROUTER).encode()
        await reg.client.put(key, report.model_dump_json().encode(), lease=lease)

        async def degraded() -> dict[str, Any] | None:
            cond = await integrity_condition(k8s_api, ns)
            return cond if cond is not None and cond["status"] == "True" else None

        cond = await eventually(degraded, "IntegrityDegraded True", within=20)
        condition_s = time.monotonic() - put_at
        assert cond["reason"] == "PairsQuarantined"
        assert f"{PREFILL} -> {DECODE} (prompt of another request)" in cond["message"]

        async def quarantined_event() -> list[tuple[str, str]] | None:
            return await event_notes(k8s_api, ns, "PairQuarantined") or None  # none yet: keep polling

        ((kind, note),) = await eventually(quarantined_event, "PairQuarantined Event", within=20)
        assert kind == "Warning"
        assert note == f"pair {PREFILL} -> {DECODE} quarantined by router(s) {ROUTER}: prompt of another request"

        await lease.revoke()  # the router is gone: etcd deletes its report with its lease
        revoked_at = time.monotonic()
        await eventually(clean, "IntegrityDegraded False again", within=20)
        cleared_s = time.monotonic() - revoked_at

        async def released_event() -> list[tuple[str, str]] | None:
            return await event_notes(k8s_api, ns, "PairReleased") or None  # none yet: keep polling

        ((kind, note),) = await eventually(released_event, "PairReleased Event", within=20)
        assert kind == "Normal"
        assert f"{PREFILL} -> {DECODE}" in note
        assert len(await event_notes(k8s_api, ns, "PairQuarantined")) == 1  # one Event per transition
    print(
        f"\nintegrity: condition True {condition_s:.2f}s after the report, False {cleared_s:.2f}s after its lease ended"
    )


@pytest.mark.timeout(300)  # paced on the operator (below), not a fixed budget
@pytest.mark.usefixtures("health_pods")  # the groups must be Ready (their probe passing) to be registered
async def test_a_repeat_offender_reported_by_a_router_gets_its_group_recreated(
    k8s_api: client.ApiClient, k8s_namespace: str, operator: ManagedProcess, etcd_endpoint: str
) -> None:
    ns = k8s_namespace
    await create_pdcluster(k8s_api, ns, pdcluster("sim"))
    async with Registry(etcd_endpoint) as reg:

        async def decode_registered() -> registry.Endpoint | None:
            return (await reg.endpoints(ns, "sim")).get("decode-0")

        before = await eventually(decode_registered, "decode-0 registered", within=60)
        offender = RepeatOffender(
            role=registry.Role.DECODE,
            worker=before.url,
            epoch=before.epoch,
            quarantines=3,
            reason="failed on probation",
        )
        lease = await reg.client.lease(60)
        key = registry.integrity_key(ns, "sim", ROUTER).encode()
        report = IntegrityReport(router=ROUTER, repeat_offenders=(offender,))
        put_at = time.monotonic()
        await reg.client.put(key, report.model_dump_json().encode(), lease=lease)

        async def recreate_event() -> list[tuple[str, str]] | None:
            return await event_notes(k8s_api, ns, "IntegrityRecreate") or None  # none yet: keep polling

        # Paced on the operator's own steps: its decision (the Event), then the new pods' start and readiness,
        # which a busy machine stretches (10.7 s in all on an idle one).
        ((kind, note),) = await eventually(recreate_event, "IntegrityRecreate Event", within=60)
        assert kind == "Warning"
        assert f"quarantined 3 times by router {ROUTER}" in note
        decided_s = time.monotonic() - put_at

        async def recreated() -> registry.Endpoint | None:
            endpoint = await decode_registered()
            return endpoint if endpoint is not None and endpoint.epoch > before.epoch else None

        after = await eventually(recreated, "decode-0 recreated with the next epoch", within=120)
        recreated_s = time.monotonic() - put_at
        # The report still names the old incarnation: nothing more is recreated.
        await asyncio.sleep(2)
        assert (await decode_registered()) == after
        assert len(await event_notes(k8s_api, ns, "IntegrityRecreate")) == 1
        await lease.revoke()
    print(
        f"\nintegrity: repeat offender's group fenced {decided_s:.1f}s after the report, registered again with epoch "
        f"{after.epoch} {recreated_s:.1f}s after it"
    )
