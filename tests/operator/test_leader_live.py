"""Two ``tandem operator`` replicas with leader election on the real control plane.

Only the Lease holder reconciles; killing it with SIGKILL (no release) hands over to the standby once the Lease
expires, without losing a registry entry, and the new leader reconciles a change made after the failover.
"""

from __future__ import annotations

import asyncio
import json
import signal
import time
from pathlib import Path
from typing import Any

import pytest
from kubernetes_asyncio import client

from tandem_dev.devcluster.operator_proc import lease_holder
from tandem_operator.run.main import parse_args
from tests.operator.live import (
    Live,
    Registry,
    create_pdcluster,
    operator_process,
    pdc_status,
    pdcluster,
    pods,
    ready,
    run_tool,
)
from tests.tandem_dev.devcluster.devcluster_fixtures import eventually

pytestmark = [pytest.mark.k8s, pytest.mark.timeout(180)]

DEFAULTS = parse_args([])  # the shipped timings are the ones under test
# Worst case after a kill: the Lease was renewed just before it, lasts its duration, and the standby's next
# attempt comes up to one retry later; the margin covers API round trips on a shared 2-core machine.
FAILOVER_BOUND_S = DEFAULTS.leader_lease_duration + DEFAULTS.leader_retry + 2.0


async def event_reporters(api: client.ApiClient, namespace: str) -> dict[str, set[str]]:
    """reason -> reportingInstance of every Event in the namespace posted by the operator."""
    # Raw JSON: the generated model rejects the controller-manager's Events, which have no eventTime.
    response: Any = await client.EventsV1Api(api).list_namespaced_event(namespace, _preload_content=False)
    found: dict[str, set[str]] = {}
    for event in json.loads(await response.read())["items"]:
        if event.get("reportingController") == "tandem.dev/operator":
            found.setdefault(event["reason"], set()).add(event["reportingInstance"])
    return found


@pytest.mark.usefixtures("health_pods")
async def test_only_the_leader_reconciles_and_the_standby_takes_over_after_a_kill(
    live: Live,
) -> None:
    ns = live.ns
    first = operator_process(live.cluster, ns, live.etcd, live.tmp, "op-a", leader_election=True).start()
    second = None
    try:
        await eventually(lambda: _holds(live.api, ns, "op-a"), "op-a leading", within=30)
        second = operator_process(live.cluster, ns, live.etcd, live.tmp, "op-b", leader_election=True).start()
        await eventually(lambda: _logged(second.log_path, "waiting for leadership"), "op-b standing by", within=30)

        await create_pdcluster(live.api, ns, pdcluster("sim"))
        await eventually(lambda: ready(live.api, ns, "sim", 1, 1), "PDCluster sim Ready", within=60)
        names = sorted(p.metadata.name for p in await pods(live.api, ns))
        assert names == ["sim-decode-0-0", "sim-decode-0-1", "sim-prefill-0-0"]  # no duplicate group
        reporters = await event_reporters(live.api, ns)
        assert reporters.get("Registered") == {"op-a"}, reporters
        assert set().union(*reporters.values()) == {"op-a"}  # the standby wrote nothing
        assert not await _logged(second.log_path, "leadership acquired")

        async with Registry(live.etcd) as reg:
            await eventually(lambda: _count(reg, ns, 2), "both groups registered", within=30)
            (old_lease,) = await reg.leases(ns, "sim")

            first.signal(signal.SIGKILL)  # a crash: the Lease is not released
            killed = time.monotonic()
            fewest_entries = 2
            while (holder := await lease_holder(live.api, ns)) != "op-b":
                assert holder == "op-a", holder
                assert time.monotonic() - killed < FAILOVER_BOUND_S + 5, "standby did not take over"
                fewest_entries = min(fewest_entries, len(await reg.endpoints(ns, "sim")))
                await asyncio.sleep(0.05)
            failover_s = time.monotonic() - killed

            async def reput() -> bool:
                leases = await reg.leases(ns, "sim")
                return len(await reg.endpoints(ns, "sim")) == 2 and leases != {old_lease} and len(leases) == 1

            while not await reput():
                fewest_entries = min(fewest_entries, len(await reg.endpoints(ns, "sim")))
                assert time.monotonic() - killed < FAILOVER_BOUND_S + 15, "entries not re-put by the new leader"
                await asyncio.sleep(0.05)
            reregistered_s = time.monotonic() - killed
            print(
                f"\nleader failover: Lease taken over {failover_s:.2f}s after SIGKILL (bound {FAILOVER_BOUND_S:.0f}s, "
                f"lease {DEFAULTS.leader_lease_duration}s, retry {DEFAULTS.leader_retry}s); registry entries re-put "
                f"under the new leader's etcd lease after {reregistered_s:.2f}s; fewest entries seen {fewest_entries}/2"
            )
            assert failover_s <= FAILOVER_BOUND_S
            assert fewest_entries == 2  # the old leader's etcd lease outlived the failover

            await run_tool(live.cluster, "kubectl", "-n", ns, "scale", "pdpool/sim-decode", "--replicas=2")
            await eventually(lambda: ready(live.api, ns, "sim", 1, 2), "op-b scaled decode to 2 groups", within=60)
            await eventually(lambda: _count(reg, ns, 3), "decode-1 registered by op-b", within=30)
        assert len(await pods(live.api, ns, "tandem.dev/role=decode")) == 4
        reporters = await event_reporters(live.api, ns)
        assert "op-b" in reporters.get("ScaledUp", set()), reporters  # the scale was reconciled by the new leader
        assert (await pdc_status(live.api, ns, "sim")).get("phase") == "Ready"
    finally:
        first.stop()
        if second is not None:
            second.stop()


async def _holds(api: client.ApiClient, namespace: str, identity: str) -> bool:
    return await lease_holder(api, namespace) == identity


async def _logged(log: Path, message: str) -> bool:
    def read() -> str:
        return log.read_text(errors="replace") if log.exists() else ""

    return message in await asyncio.to_thread(read)


async def _count(reg: Registry, namespace: str, n: int) -> bool:
    return len(await reg.endpoints(namespace, "sim")) == n
