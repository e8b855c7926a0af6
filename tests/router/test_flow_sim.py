"""Tenant flow control on simulated workers (issue 36): quiet tenants keep their TTFT while another floods.

2 prefill + 2 decode ``tandem sim`` workers (8 requests at once per decode) behind the default router (flow control
on, ``--client-id-header X-Tenant``) and one with ``--no-flow-control``, measured in turn on the same workers: 4
quiet tenants x 2 streams alone, then beside a tenant flooding with 80 streams (wrk). Medians, side by side in one
run, so the figures hold on a busy machine (``tandem bench tenants`` reports the p99s).
"""

from __future__ import annotations

import asyncio
from pathlib import Path

import pytest

from tandem_dev import peers
from tandem_dev.router.bench import wrk
from tandem_dev.router.bench_tenants import BODY, FLOOD, OFF, ON, pct, quiet_ttft, quiet_under_flood, stack

pytestmark = [pytest.mark.netns, pytest.mark.procs, pytest.mark.slow]


@pytest.mark.timeout(600)
def test_quiet_tenants_keep_their_ttft_under_a_flood(tmp_path: Path) -> None:
    peers.require("wrk")
    p50: dict[tuple[str, str], float] = {}
    with stack(tmp_path, instant=False) as routers, asyncio.Runner() as runner:
        for url, _ in routers.values():
            wrk(url, BODY, FLOOD, 2, tmp_path)  # the routers learn the decodes' capacity
        for name in (ON, OFF):
            url = routers[name][0]
            alone = runner.run(quiet_ttft(url, 4))
            flooded, _ = runner.run(quiet_under_flood(url, 4, tmp_path))
            assert alone.errors == flooded.errors == 0
            p50[name, "alone"], p50[name, "flooded"] = pct(alone.ttft_ms, 0.5), pct(flooded.ttft_ms, 0.5)
    print(p50)
    # Flooded / alone p50 measures 1.8-3.1x (a quiet request shares the machine's 2 cores with the flood's work;
    # `tandem bench tenants` in router/README.md: 65 / 37 ms at load average 4.6-8.5, 29 / 9.0 ms at 2.5-4.6), the
    # alone p50 being the noisy side; without flow control it is 18-60x. Issue 36's target is on p99 (1.5x): 1.5-2.5x.
    assert p50[ON, "flooded"] < 4 * p50[ON, "alone"]
    assert p50[ON, "flooded"] * 3 < p50[OFF, "flooded"]
