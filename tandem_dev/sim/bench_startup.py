"""``tandem bench sim-startup``: how long a recreated Kimi K2.6 decode takes to serve, per weight source (issue #35).

A decode worker with ``--sim-profile kimi-k2.6-h200 --sim-load-phases`` starts three ways: downloading the
checkpoint (``--load-format auto``, a hub id), reading the node's copy (``--model-path`` a directory), pulling from a
running seed over the Mooncake transfer engine (``--load-format remote_instance``, real bytes: ``--sim-weight-mb``
per rank). Measured: process start to ``/health`` 200, minus the same process's start without load phases (the
simulator's own start-up), divided by ``--sim-time-factor``. Compared with the profile's model (every phase plus
the warm-up request) and the physical bound (bytes over bandwidth plus JIT and CUDA-graph warm-up); the goal of
issue #35 is serving within 90 s from a peer.

Then decode scaled 1 -> 4 (``tandem_dev.scaleout``): which source the operator's own seed choice gives each new group
of ``deploy/kimi-k26-h200.yaml``, with ``spec.peerLoading`` on (``maxLoadsPerSeed`` 2) and off, and when it serves at
the per-source times above.
"""

from __future__ import annotations

import tempfile
import time
from collections.abc import Sequence
from pathlib import Path

from tandem.registry import Role
from tandem_dev.bench import BenchArgs, Table
from tandem_dev.procs import free_port
from tandem_dev.scaleout import StartTimes, modelled_times, recipe_spec, scale_out
from tandem_dev.sim.testing import HOST, start_worker
from tandem_sim.config import parse
from tandem_sim.model.profiles import KIMI_LOAD
from tandem_sim.model.weights import phases, physical_bound_s

GOAL_S = 90.0
NODE, PEER = "node copy (NVMe)", "peer (Mooncake)"
DECODE = ["--disaggregation-mode", "decode", "--sim-profile", "kimi-k2.6-h200", "--sim-weight-mb", "8"]


def _serving_s(name: str, log_dir: Path, argv: Sequence[str]) -> float:
    started = time.monotonic()
    worker = start_worker(name, log_dir, argv, timeout=900)
    took = time.monotonic() - started
    worker.proc.stop()
    return took


def _sources(model_dir: Path, seed_port: int) -> list[tuple[str, list[str]]]:
    peer = ["--load-format", "remote_instance", "--remote-instance-weight-loader-backend", "transfer_engine"]
    peer += ["--remote-instance-weight-loader-seed-instance-ip", HOST]
    peer += ["--remote-instance-weight-loader-seed-instance-service-port", str(seed_port)]
    return [
        ("hub download", []),
        (NODE, ["--model-path", str(model_dir)]),
        (PEER, peer),
    ]


def run(args: BenchArgs) -> list[Table]:
    factor = 0.02 if args.quick else 0.1
    table = Table(
        "sim-startup: recreated K2.6 decode -> serving, per weight source",
        ["source", "phases", "modelled s", "measured s", "physical bound s", f"<= {GOAL_S:g} s"],
    )
    with tempfile.TemporaryDirectory(prefix="tandem-bench-startup-") as tmp:
        log_dir = Path(tmp)
        (model_dir := log_dir / "Kimi-K2.6").mkdir()
        seed_flags = ["--remote-instance-weight-loader-start-seed-via-transfer-engine", "--sim-weight-mb", "8"]
        seed = start_worker("seed", log_dir, [*seed_flags, "--engine-info-bootstrap-port", str(free_port())])
        try:
            scale = ["--sim-time-factor", str(factor)]
            measured_s: dict[str, float] = {}
            baseline = min(_serving_s(f"baseline{i}", log_dir, [*DECODE, *scale]) for i in range(2))
            for name, flags in _sources(model_dir, seed.port):
                argv = [*DECODE, *scale, *flags]
                cfg = parse(["--model-path", "sim/model", *argv, "--sim-load-phases"])
                plan = phases(KIMI_LOAD, cfg.load, cfg.tp_size, len(cfg.topology.local_ranks()))
                modelled = sum(p.seconds for p in plan) + KIMI_LOAD.server_warmup_s
                took = _serving_s(name.split()[0], log_dir, [*argv, "--sim-load-phases"])
                measured = measured_s[name] = (took - baseline) / factor
                bound = physical_bound_s(KIMI_LOAD, cfg.load, cfg.tp_size, len(cfg.topology.local_ranks()))
                spelled = " + ".join(f"{p.name} {p.seconds:.1f}" for p in plan if p.seconds)
                table.rows.append([name, spelled, modelled, measured, bound, "yes" if measured <= GOAL_S else "no"])
        finally:
            seed.proc.stop()
    table.notes += [
        f"--sim-time-factor {factor:g}; measured = (start to /health 200 - {baseline:.2f} s without load phases) / "
        "factor; modelled adds the warm-up request (status Starting) to the phases",
        "profile kimi-k2.6-h200 (tandem_sim/model/profiles.py: KIMI_LOAD): 600 GB, hub 1.25 GB/s (estimate), node copy "
        "12 GB/s (a published SGLang log), peer 190 GB/s (Mooncake, 8x400G RoCE, published), JIT 20 s and init "
        "15 s (estimates), CUDA graphs 12 s (a published log)",
    ]
    return [table, scale_out_table(StartTimes(measured_s[NODE], measured_s[PEER]))]


def scale_out_table(measured: StartTimes, start: int = 1, target: int = 4) -> Table:
    """Decode ``start`` -> ``target`` at 0 s: each new group's source by the operator's choice, when it serves."""
    modelled = modelled_times(recipe_spec(True), Role.DECODE)
    table = Table(
        f"sim-startup: decode scaled {start} -> {target}, each new group's weight source (the operator's choice)",
        ["peerLoading", "new group", "source", "serving at s (modelled)", "serving at s (measured)"],
    )
    for enabled in (True, False):
        made_m, made_x = scale_out(modelled, enabled, start, target), scale_out(measured, enabled, start, target)
        for m, x in zip(made_m, made_x, strict=True):
            source = NODE if m.seed is None else f"{PEER} from decode-{m.seed}"
            table.rows.append(["on" if enabled else "off", f"decode-{m.index}", source, m.ready_at, x.ready_at])
        last = [max(g.ready_at for g in made) for made in (made_m, made_x)]
        table.rows.append(["on" if enabled else "off", f"all {target} serving", "", *last])
    table.notes += [
        "deploy/kimi-k26-h200.yaml (decode: 1 node, TP 8), spec.peerLoading {enabled, maxLoadsPerSeed: 2} (default "
        "limit); the operator's seed_pool + steps (decide/planner.py) pick each group's source at the scale-up; a "
        "group that loaded from a peer never seeds, so the one past the seed's limit reads the node's copy",
        f"modelled: tandem_sim.model.weights phases + warm-up with the seed flag every operator pod has (node copy "
        f"{modelled.node_s:.1f} s: +{KIMI_LOAD.register_s:g} s register over the table above; peer "
        f"{modelled.peer_s:.1f} s); measured: the table above's times per source; each pull timed as if alone "
        "(a seed's egress shared by 2 pulls adds ~3 s), no pod scheduling or image pull",
    ]
    return table
