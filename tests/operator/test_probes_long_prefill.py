"""The worker probes against a 256K-token prefill of the ``kimi-k2.6-h200`` profile (issue #34, part 6).

Two ``tandem sim`` workers (aggregated mode: the scheduler and health semantics are a prefill's) each get two
262,143-token prompts, each in **one** batch (``--chunked-prefill-size -1``): 40.1 s of simulated GPU time a
prompt, the longest forward the profile allows, back to back. SGLang 0.5.23 answers a health check on a busy
scheduler after its next batch (``Scheduler.maybe_send_health_check_signal``), so with the recipe's 16384-token
chunks (2.5 s a batch) even the old probe passes; a batch longer than ``SGLANG_HEALTH_CHECK_TIMEOUT`` is what fails
a generation check. Meanwhile each worker is probed as the kubelet probes (``tandem_dev.devcluster.probes``: each
probe on its own loop, the next one at its period or at once after a slow one):

- with the probes the operator renders now (``desired/probes.py``: readiness ``/ready``, liveness
  ``/health_generate`` with ``SGLANG_HEALTH_CHECK_TIMEOUT`` = 45 s): 0 readiness and 0 liveness failures;
- with the probes it rendered before (readiness and liveness on ``/health``, SGLang's default 20 s timeout):
  every forward fails at least one readiness check (each after 20 s; a check starts within one 10 s period of
  the forward's start). Two in a row make the pod NotReady and the operator unroutes its group, but with a 40.1 s
  forward that needs a check to start within 0.1 s of the forward (2 x 20 s of the 40.1 s): it happens, by the
  phase of the probe loop, and is printed, not asserted.

Time scale: ``--sim-time-factor 0.5`` (``SCALE``) makes each forward 20.05 s of wall time; every probe period and
timeout and ``SGLANG_HEALTH_CHECK_TIMEOUT`` are scaled by the same factor, so the test takes ~45 s.
"""

from __future__ import annotations

import asyncio
import contextlib
import dataclasses
import time
from pathlib import Path
from typing import Any

import aiohttp
import pytest

from tandem.registry import Role
from tandem_dev.devcluster.probes import LIVENESS, READINESS, Probe, ProbeTarget, ProbeTracker, check
from tandem_dev.sim.testing import HOST, SimWorker, start_worker
from tandem_operator.desired.pods import RoleContext, group_pod
from tandem_sim.model.profiles import PROFILES
from tests.operator.conftest import kimi_spec
from tests.operator.workers import CLUSTER, POOL

pytestmark = [pytest.mark.procs, pytest.mark.timeout(300)]
SCALE = 0.5
PROMPT_TOKENS = 262_143  # --context-length 262144 (the K2.6 recipe's) less the one output token
PROMPTS = 2
# What desired/pods.py rendered before issue #34 (SGLang's default SGLANG_HEALTH_CHECK_TIMEOUT, 20 s).
OLD_PROBES: dict[str, Any] = {
    "readinessProbe": {"httpGet": {"path": "/health", "port": "http"}, "periodSeconds": 10, "timeoutSeconds": 20,
                       "failureThreshold": 2},
    "livenessProbe": {"httpGet": {"path": "/health", "port": "http"}, "periodSeconds": 30, "timeoutSeconds": 30,
                      "failureThreshold": 5},
}  # fmt: skip
OLD_TIMEOUT_S = 20


@dataclasses.dataclass
class Record:
    results: list[tuple[float, float, bool]] = dataclasses.field(default_factory=list)  # start, end, ok
    ready: asyncio.Event = dataclasses.field(default_factory=asyncio.Event)  # the probe has succeeded
    turned_unready: bool = False

    @property
    def failures(self) -> int:
        return sum(not ok for _, _, ok in self.results)


def _scaled(probe: Probe) -> Probe:
    t = probe.timing
    timing = dataclasses.replace(t, period_s=t.period_s * SCALE, timeout_s=t.timeout_s * SCALE)
    return dataclasses.replace(probe, timing=timing)


async def _probe_loop(probe: Probe, kind: str, port: int, session: aiohttp.ClientSession, record: Record) -> None:
    """One kubelet probe worker (``prober/worker.go``): readiness starts failed, liveness succeeded."""
    tracker = ProbeTracker(probe, ready=kind == LIVENESS)
    target = ProbeTarget(HOST, lambda argv: list(argv))
    while True:
        began = time.monotonic()
        ok = await check(dataclasses.replace(probe, port=port), target, session)
        record.results.append((began, time.monotonic(), ok))
        was = tracker.ready
        tracker.record(ok)
        record.turned_unready |= was and not tracker.ready
        if tracker.ready:
            record.ready.set()
        await asyncio.sleep(max(0.0, began + probe.timing.period_s - time.monotonic()))


async def _prefill_under_probes(worker: SimWorker, probes: dict[str, Probe]) -> tuple[dict[str, Record], float]:
    """Probe ``worker`` while it prefills the long prompt; the records and the prefill's wall time."""
    records = {kind: Record() for kind in probes}
    async with aiohttp.ClientSession(timeout=aiohttp.ClientTimeout(total=None)) as session:
        loops = [
            asyncio.create_task(_probe_loop(probe, kind, worker.port, session, records[kind]))
            for kind, probe in probes.items()
        ]
        try:
            async with asyncio.timeout(60):
                await records[READINESS].ready.wait()  # the pod is Ready (and routed) when the prompt comes
            started = time.monotonic()
            await asyncio.gather(*(_long_prompt(session, worker, n) for n in range(PROMPTS)))
            took = time.monotonic() - started
            async with session.get(f"{worker.url}/server_info") as resp:
                (state,) = (await resp.json())["internal_states"]
            assert (state["prefill_batches"], state["prefill_chunks"]) == (PROMPTS, 0)  # a batch per prompt
        finally:
            for loop in loops:
                loop.cancel()
            for loop in loops:
                with contextlib.suppress(asyncio.CancelledError):
                    await loop
    return records, took


async def _long_prompt(session: aiohttp.ClientSession, worker: SimWorker, n: int) -> None:
    body = {"input_ids": [5 + n] * PROMPT_TOKENS, "sampling_params": {"max_new_tokens": 1}}
    async with session.post(f"{worker.url}/generate", json=body) as resp:
        assert resp.status == 200, await resp.text()


def _worker(name: str, tmp_path: Path, health_timeout_s: float) -> SimWorker:
    extra = [
        *("--sim-profile", "kimi-k2.6-h200", "--sim-time-factor", str(SCALE)),
        *("--context-length", "262144", "--max-total-tokens", "530000", "--chunked-prefill-size", "-1"),
        *("--sim-kv-bytes-per-token", "64", "--disable-radix-cache"),  # less of the simulator's own CPU work
    ]
    return start_worker(name, tmp_path, extra, env={"SGLANG_HEALTH_CHECK_TIMEOUT": str(health_timeout_s * SCALE)})


async def test_256k_prefills_fail_no_new_probe_and_failed_the_old_readiness(tmp_path: Path) -> None:
    forward_s = PROFILES["kimi-k2.6-h200"].prefill_s(PROMPT_TOKENS)
    assert forward_s == pytest.approx(40.1, abs=0.05)
    container = group_pod(RoleContext.build(CLUSTER, kimi_spec(), Role.PREFILL, POOL), 0, 0)["spec"]["containers"][0]
    container = {**container, "ports": [{"name": "http", "containerPort": 0}]}  # the worker's port comes later
    new_timeout = float(next(v["value"] for v in container["env"] if v["name"] == "SGLANG_HEALTH_CHECK_TIMEOUT"))
    assert new_timeout > forward_s
    old = {**container, **OLD_PROBES}

    def probes_of(c: dict[str, Any]) -> dict[str, Probe]:
        return {kind: _scaled(p) for kind in (READINESS, LIVENESS) if (p := Probe.parse(c, kind)) is not None}

    new_worker, old_worker = _worker("new-probes", tmp_path, new_timeout), _worker("old-probes", tmp_path, 20)
    try:
        (new, new_took), (before, old_took) = await asyncio.gather(
            _prefill_under_probes(new_worker, probes_of(container)),
            _prefill_under_probes(old_worker, probes_of(old)),
        )
    finally:
        new_worker.proc.stop()
        old_worker.proc.stop()
    failed = {
        name: f"{r.failures}/{len(r.results)}" for name, r in (("new", new[READINESS]), ("old", before[READINESS]))
    }
    print(
        f"\n256K prefill {new_took:.1f} / {old_took:.1f} s wall (x{SCALE}); readiness probes failed: {failed}, "
        f"liveness (new) {new[LIVENESS].failures}/{len(new[LIVENESS].results)}; old NotReady: "
        f"{before[READINESS].turned_unready}"
    )
    assert min(new_took, old_took) >= PROMPTS * forward_s * SCALE  # the forwards really ran
    assert len(new[LIVENESS].results) >= 2  # generation checks ran during the forward ...
    assert new[LIVENESS].failures == 0  # ... and waited for it: none failed, so /ready stayed 200
    assert new[READINESS].failures == 0
    assert len(new[READINESS].results) >= 4
    assert before[READINESS].failures >= PROMPTS  # the old readiness probe failed during every forward
