"""Tenant flow control on simulated workers (issue 36): quiet tenants keep their TTFT while another floods.

2 prefill + 2 decode ``tandem sim`` workers (8 requests at once per decode) behind the default router (flow control
on, ``--client-id-header X-Tenant``) and one with ``--no-flow-control``, measured in turn on the same workers: 4
quiet tenants x 2 streams beside a tenant flooding with 80 streams (wrk). The yardstick is the machine's share: the
same quiet tenants while the same flood goes to a second set of workers behind a router of its own, so that the two
share nothing but the machine's 2 cores. Medians, side by side in one run, so the figures hold on a busy machine
(``tandem bench tenants`` reports the p99s).
"""

from __future__ import annotations

import asyncio
from pathlib import Path

import pytest

from tandem_dev import peers
from tandem_dev.router.bench import wrk
from tandem_dev.router.bench_tenants import BODY, FLOOD, MACHINE, OFF, ON, pct, quiet_under_flood, stack

pytestmark = [pytest.mark.netns, pytest.mark.procs, pytest.mark.slow]


@pytest.mark.timeout(600)
def test_quiet_tenants_under_a_flood_keep_the_ttft_the_machine_leaves_them(tmp_path: Path) -> None:
    peers.require("wrk")
    ttft: dict[str, list[float]] = {ON: [], MACHINE: [], OFF: []}
    with (
        stack(tmp_path, instant=False) as routers,
        stack(tmp_path / "elsewhere", instant=False, targets=(ON,)) as elsewhere,
        asyncio.Runner() as runner,
    ):
        for url, _ in (*routers.values(), *elsewhere.values()):
            wrk(url, BODY, FLOOD, 2, tmp_path)  # the routers learn the decodes' capacity
        phases = {ON: (ON, None), MACHINE: (ON, elsewhere[ON][0]), OFF: (OFF, None)}
        for name in (ON, MACHINE, MACHINE, ON, OFF):  # ABBA: the machine's load drifting moves both sides alike
            quiet_at, flood_at = phases[name]
            flooded, _ = runner.run(quiet_under_flood(routers[quiet_at][0], 3, tmp_path, flood_at))
            assert flooded.errors == 0
            ttft[name] += flooded.ttft_ms
    p50 = {name: pct(values, 0.5) for name, values in ttft.items()}
    print(p50)
    # The default router under the flood / the machine's share: p50 0.48-1.97x here at load average 7-11 (other
    # work running), 0.77-0.78x (p99 0.94-1.05x) in 10 s phases at load 2-3: flow control leaves the quiet tenants
    # about what the flood's CPU load leaves them. Against the quiet tenants alone (no flood anywhere) the same p50 was
    # 1.8-5.4x, the machine's doing (CI once measured 5.4x beside the other worker's tests). Without flow control it
    # is 8-17x the machine's share.
    assert p50[ON] < 3 * p50[MACHINE]
    assert p50[ON] * 3 < p50[OFF]
