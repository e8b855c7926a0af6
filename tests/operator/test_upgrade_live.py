"""Upgrades without surprises on the real control plane: an operator whose rendering changed (one more env var in
every worker pod, the spec untouched) leaves the serving pods alone under the default upgradePolicy (Manual) and
says so in the PodsOutdated condition; ``tandem.dev/roll`` rolls them, through the drain and revision-coherent
pairing, under streaming load, and the operator removes the annotation when done."""

from __future__ import annotations

import asyncio
import sys
from typing import Any

import pytest

from tests.operator.live import (
    REPO,
    SIM_MODEL,
    Live,
    load_result,
    operator_process,
    pdc_status,
    pods,
    run_tool,
    sim_stack,
    start_load,
)
from tests.operator.upgraded_operator import UPGRADE_ENV
from tests.tandem_dev.devcluster.devcluster_fixtures import eventually

pytestmark = [pytest.mark.k8s, pytest.mark.netns, pytest.mark.timeout(300)]
ONE_NODE = {"groups": 1, "nodesPerGroup": 1, "gpusPerNode": 1, "tpSize": 1, "epSize": 1, "moeA2ABackend": "none"}


def _condition(status: dict[str, Any], kind: str) -> dict[str, str]:
    found = [c for c in status.get("conditions") or [] if isinstance(c, dict) and c.get("type") == kind]
    return found[0] if found else {}


async def test_an_operator_only_change_waits_for_the_trigger_then_rolls_under_load(live: Live) -> None:
    ns = live.ns
    spec = {"prefill": {**ONE_NODE}, "decode": {**ONE_NODE, "extraArgs": ["--sim-inter-token-ms=20"]}}
    async with sim_stack(live, ["decode-0", "prefill-0"], **spec) as sim:
        before = {p.metadata.name: p.metadata.uid for p in await pods(live.api, ns)}
        old = live.procs.pop(0)  # sim_stack's operator
        old.stop()
        upgraded = operator_process(live.cluster, ns, live.etcd, live.tmp, "op-upgraded")
        upgraded.argv = [sys.executable, "-m", "tests.operator.upgraded_operator", *upgraded.argv[4:]]
        upgraded.cwd = REPO
        live.procs.append(upgraded.start())

        async def outdated() -> dict[str, str] | None:
            found = _condition(await pdc_status(live.api, ns, "sim"), "PodsOutdated")
            return found if found.get("status") == "True" and UPGRADE_ENV in found.get("message", "") else None

        held = await eventually(outdated, "PodsOutdated names the new env var", within=60)
        await asyncio.sleep(12.0)  # two resyncs (5 s) more: still nothing rolls
        assert {p.metadata.name: p.metadata.uid for p in await pods(live.api, ns)} == before
        assert _condition(await pdc_status(live.api, ns, "sim"), "PodsOutdated")["status"] == "True"

        load = await start_load(sim.base_url, SIM_MODEL, 8, 45.0, max_tokens=50)
        await asyncio.sleep(3.0)
        await run_tool(live.cluster, "kubectl", "-n", ns, "annotate", "pdcluster/sim", "tandem.dev/roll=all")

        async def rolled() -> bool:
            now = await pods(live.api, ns)
            envs = [{e.name for e in p.spec.containers[0].env or ()} for p in now]
            done = sorted(p.metadata.name for p in now) == ["sim-decode-1-0", "sim-prefill-1-0"]
            return done and all(UPGRADE_ENV in e for e in envs)

        await eventually(rolled, "both roles rolled onto the upgraded rendering", within=150)
        result = await load_result(load, within=120)

        async def settled() -> bool:
            obj = await run_tool(live.cluster, "kubectl", "-n", ns, "get", "pdcluster/sim", "-o", "json")
            status = await pdc_status(live.api, ns, "sim")
            cleared = "tandem.dev/roll" not in obj[1]
            return cleared and _condition(status, "PodsOutdated").get("status") == "False"

        await eventually(settled, "the annotation removed and PodsOutdated False", within=30)
    print(
        f"\nheld: {held['message']}\nrolled under load: {result['ok']} ok, {result['cut_mid_stream']} cut, "
        f"{len(result['failed_before_first_byte'])} failed"
    )
    assert result["failed_before_first_byte"] == []
    assert result["cut_mid_stream"] == 0
