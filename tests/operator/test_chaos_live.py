"""``tandem chaos --setting dev-cluster``, tiny: the operator as 2 replicas with leader election, 2 prefill + 2
decode simulated pods, a 3-member registry etcd, 2 routers; one fault of each kind, the operator leader's included,
under load. The run's report must keep every invariant: every stream ends equal to its reference but those cut
on their killed router (nothing garbled, hung, lost, or failed or cut without a resume), every fault recovered, and
the Lease taken over by the other replica after the leader's kill.

A prefill's kill is the case that found the stale-bootstrap hang: recreated within seconds on the same pod IP, the
new prefill meets decodes that never missed two of its heartbeats. It comes back on the next port of its bootstrap
range (``PortSet.bootstrap_at``), so decodes meet it as a new peer; before that, their streams hung (README.md,
"Chaos", dev cluster).

Generous bounds (``cap_s``): the machine is shared and loaded; the numbers are published by ``tandem chaos``.
"""

from __future__ import annotations

import orjson
import pytest

from tandem_dev.chaos.cli import DEV_CLUSTER_KINDS, save
from tandem_dev.chaos.devcluster import run_on_cluster
from tandem_dev.chaos.report import Verdict, violations
from tandem_dev.chaos.run import ChaosArgs
from tests.operator.live import Live

pytestmark = [pytest.mark.k8s, pytest.mark.netns, pytest.mark.procs, pytest.mark.slow, pytest.mark.timeout(900)]


async def test_a_tiny_dev_cluster_chaos_run_keeps_every_invariant_and_the_leader_fails_over(live: Live) -> None:
    kinds = tuple(k for k in DEV_CLUSTER_KINDS if k != "registry")  # the 20 s registry freeze: its own test below
    args = ChaosArgs(
        concurrency=4, duration_s=120.0, faults=len(kinds), kinds=kinds, max_tokens=60, prompts=6, seed=1,
        cap_s=120.0, setting="dev-cluster",
    )  # fmt: skip
    report = await run_on_cluster(args, live.cluster, live.api, live.ns, live.tmp)
    counts = report.counts()
    print(dict(counts), report.router_counters, *report.faults, sep="\n")
    # Every stream ends equal to its reference (resumed where its decode died) but those cut on their killed
    # router, counted apart: no stream moves across routers, and at most `concurrency` are in flight on one at its
    # kill (one killed between the status line and its first event is lost before its first byte: exempt too).
    assert violations(report) == []
    assert counts[Verdict.OK] > 0
    assert counts[Verdict.ROUTER_KILLED] <= args.concurrency * sum(f.kind == "router" for f in report.faults)
    injected = [f.kind for f in report.faults]
    assert "operator" in injected, injected  # the plan reached the leader kill before the load ended
    (leader,) = [f for f in report.faults if f.kind == "operator"]
    assert leader.fenced is not None  # the other replica took the Lease
    assert leader.recovered is not None
    assert leader.fenced < leader.recovered  # the decode killed after the takeover was recovered by the new leader
    for fault in report.faults:
        if fault.kind in ("prefill", "decode"):
            assert fault.fenced is not None, fault
        if fault.kind in ("prefill", "decode", "transfer"):
            # transfer: fenced only if a router tried the broken pair in its 5 s, which the cache-aware policy may
            # not do with 4 streams; the prefill must stop blacklisting the decode either way.
            assert fault.recovered is not None, fault
    saved = orjson.loads(save(report, live.tmp / "out", ["--setting", "dev-cluster"]).read_bytes())
    assert saved["violations"] == []
    assert saved["sections"]["chaos"]["tables"][0]["title"].startswith("chaos (dev cluster")
    assert (live.tmp / "out" / "timeline.png").stat().st_size > 1000


async def test_a_registry_frozen_20s_on_the_dev_cluster_costs_no_stream(live: Live) -> None:
    """All three registry etcd members frozen for 20 s under load, the operator (2 replicas) as the writer with its
    default lease TTL (15 s): on the thaw etcd expires the operator's lease; both routers hold that storm and the
    operator's writer puts every group back. Every stream ends OK, none resumed; back within seconds of the thaw."""
    args = ChaosArgs(
        concurrency=4, duration_s=45.0, faults=1, kinds=("registry",), max_tokens=60, prompts=6, seed=1,
        cap_s=120.0, setting="dev-cluster",
    )  # fmt: skip
    report = await run_on_cluster(args, live.cluster, live.api, live.ns, live.tmp)
    counts = report.counts()
    print(dict(counts), report.router_counters, *report.faults, sep="\n")
    assert violations(report) == []
    assert counts[Verdict.OK] == len(report.results) > 0
    assert report.router_counters.get("streams resumed", 0) == 0  # no cut hidden by a resume
    assert report.router_counters.get("registry removal storms held", 0) >= 1  # the lease did expire
    (freeze,) = report.faults
    assert freeze.recovered is not None
    assert freeze.recovered <= 20.0 + 10.0  # registrations back within seconds of the thaw
