"""A rollout registers the replacement group before it unregisters the group it retires.

With one group per role, a pass that unregistered the retired group first and registered its Ready replacement
only at the end of the pass (the registry sync) left routers without that role for the pass's length: requests in
that window failed with "no healthy prefill/decode pair" (tests/chart/test_chart_upgrade_release_k8s.py, under
load). The runtime and its reconcile pass run against a fake Kube and registrar (tests/operator/fakes.py).
"""

from __future__ import annotations

import copy

from tandem_operator.act.k8s.apply import object_path
from tests.operator.conftest import kimi_spec
from tests.operator.fakes import FakeKube
from tests.operator.test_node_maintenance import _cluster, _in_flight

SPEC = kimi_spec(transfer={"protocol": "tcp"}, upgradePolicy={"roll": "OnChange"})


def _make_ready(kube: FakeKube, group: int) -> None:
    """The decode group's pods, as the operator applied them, now scheduled, running and Ready."""
    applied = [c[2] for c in kube.verbs("apply") if c[2]["kind"] == "Pod"]
    mine = [p for p in applied if p["metadata"]["name"].startswith(f"kimi-decode-{group}-")]
    assert mine, [p["metadata"]["name"] for p in applied]
    for rank, manifest in enumerate(mine):
        pod = copy.deepcopy(manifest)
        pod["spec"]["nodeName"] = f"gpu-new-{rank}"
        pod["status"] = {"phase": "Running", "conditions": [{"type": "Ready", "status": "True"}]}
        pod["status"]["podIP"] = f"10.0.{group}.{rank + 10}"
        kube.objects[object_path(pod)] = pod


async def test_the_replacement_is_registered_before_the_retired_group_goes() -> None:
    runtime, kube, registrar, _ = _cluster(SPEC)
    _in_flight(runtime, {})
    await runtime.reconciler.reconcile_once()
    assert "decode-0" in registrar.entries

    # The decode role renders differently (rolled at once: OnChange), a new group surged first.
    decode = SPEC.decode.model_copy(update={"extra_args": [*SPEC.decode.extra_args, "--sim-inter-token-ms=5"]})
    runtime.state.spec = SPEC.model_copy(update={"decode": decode})
    runtime.state.generation += 1
    await runtime.reconciler.reconcile_once()
    assert "decode-1" not in registrar.entries  # starting: not registered yet
    registrar.log.clear()

    _make_ready(kube, 1)
    await runtime.reconciler.reconcile_once()
    order = [(verb, group) for verb, group, _ in registrar.log if group.startswith("decode")]
    assert ("put", "decode-1") in order
    assert ("unregister", "decode-0") in order
    assert order.index(("put", "decode-1")) < order.index(("unregister", "decode-0")), order
    assert sorted(g for g in registrar.entries if g.startswith("decode")) == ["decode-1"]
