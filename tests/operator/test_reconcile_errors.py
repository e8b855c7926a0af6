"""A failed reconcile pass (``decide/retry.py``): temporary failures back off, a permanent one (the API server
refusing a request as invalid) is not retried every second but sets ``ReconcileFailed`` and posts one Event, and a
new generation retries at once. The runtime runs against the fake Kube and registrar (tests/operator/fakes.py)."""

from __future__ import annotations

import asyncio
import contextlib
from typing import Any

import pytest

from tandem_operator.act.k8s.kube import PermanentError
from tandem_operator.api.common import Condition, ConditionStatus
from tandem_operator.decide.retry import (
    CONDITION_TYPE,
    PERMANENT_DELAY_S,
    ReconcileFailure,
    reconcile_condition,
    retry_delay,
)
from tandem_operator.desired.naming import ClusterRef
from tandem_operator.run.runtime import ClusterRuntime, RuntimeOptions
from tests.operator.conftest import kimi_spec
from tests.operator.fakes import FakeKube, FakeRegistrar, with_pools
from tests.operator.workers import CLUSTER
from tests.tandem_dev.devcluster.devcluster_fixtures import eventually

SPEC = kimi_spec(transfer={"protocol": "tcp"})
NOW = "2026-12-06T00:00:00Z"
TEMPORARY = ReconcileFailure(False, "GET /api/v1/pods: 0 connection lost")
INVALID = ReconcileFailure(True, "POST /api/v1/namespaces/ns/pods: 422 Invalid: spec.containers[0].image: Required")


def test_temporary_failures_back_off_to_10_s_and_a_permanent_one_waits_a_minute() -> None:
    assert [retry_delay(n, TEMPORARY) for n in range(1, 7)] == [1, 2, 4, 8, 10, 10]
    assert retry_delay(1, INVALID) == retry_delay(5, INVALID) == PERMANENT_DELAY_S == 60


def test_the_condition_is_absent_until_a_failure_then_true_then_false() -> None:
    assert reconcile_condition(None, [], 3, NOW) is None
    failed = reconcile_condition(INVALID, [], 3, NOW)
    assert failed is not None
    assert (failed.type, failed.status, failed.reason) == (CONDITION_TYPE, ConditionStatus.TRUE, "PermanentError")
    assert "422 Invalid" in failed.message
    again = reconcile_condition(INVALID, [failed], 3, "2026-12-06T00:01:00Z")
    assert again is not None
    assert again.last_transition_time == NOW  # still failing: the transition time stays
    healed = reconcile_condition(None, [failed], 4, "2026-12-06T00:02:00Z")
    assert healed is not None
    assert (healed.status, healed.reason, healed.observed_generation) == (ConditionStatus.FALSE, "Reconciled", 4)


class RefusingKube(FakeKube):
    """The API server refuses every pod it is asked to create as invalid (a 422), until ``refuse`` is False."""

    def __init__(self) -> None:
        super().__init__()
        self.refuse = True
        self.refused = 0

    async def apply(self, manifest: dict[str, Any], *, subresource: str | None = None) -> dict[str, Any]:
        if self.refuse and manifest["kind"] == "Pod":
            self.refused += 1
            raise PermanentError(422, "Invalid", f"PATCH pods/{manifest['metadata']['name']}", "spec: Required")
        return await super().apply(manifest, subresource=subresource)


def _conditions(kube: FakeKube) -> list[Condition]:
    """The PDCluster's conditions as the operator last wrote them (status merge patch or status apply)."""
    written = [c for c in kube.calls if (c[0] == "patch" and c[1].endswith("/status")) or c[0] == "apply"]
    status = [body["status"] for _verb, _path, body in written if body.get("kind", "PDCluster") == "PDCluster"]
    return [Condition.model_validate(c) for c in (status[-1].get("conditions", []) if status else [])]


def _failed(kube: FakeKube) -> Condition | None:
    return next((c for c in _conditions(kube) if c.type == CONDITION_TYPE), None)


@pytest.mark.timeout(60)
async def test_an_invalid_pod_is_not_retried_every_second_and_a_new_generation_retries_at_once() -> None:
    kube, registrar = RefusingKube(), FakeRegistrar()
    ref = ClusterRef(CLUSTER.name, CLUSTER.namespace, CLUSTER.uid)
    with_pools(kube, ref, SPEC)  # the pools exist (with their uids): the pass goes on to create the groups' pods
    runtime = ClusterRuntime(ref, SPEC, kube, registrar, RuntimeOptions("test"), dict)
    loop = asyncio.create_task(runtime._loop())  # the reconcile loop alone (start() would also watch etcd)
    runtime.kick()
    try:

        async def marked_failed() -> bool:
            found = _failed(kube)
            return found is not None and found.status is ConditionStatus.TRUE

        await eventually(marked_failed, "ReconcileFailed=True in the PDCluster's status", within=10)
        failed = _failed(kube)
        assert failed is not None
        assert failed.reason == "PermanentError"
        assert "422 Invalid" in failed.message
        refused = kube.refused
        runtime.kick()  # pod events keep coming: they do not cut a permanent failure's wait short
        await asyncio.sleep(3)
        assert kube.refused == refused  # the old loop retried every second
        events = [body for verb, path, body in kube.calls if verb == "post" and path.endswith("/events")]
        assert [e["reason"] for e in events] == ["ReconcileFailed"]
        kube.refuse = False  # the user fixes the spec: a new generation
        runtime.update(SPEC, runtime.state.generation + 1, {})

        async def reconciled() -> bool:
            found = _failed(kube)
            return found is not None and found.status is ConditionStatus.FALSE

        await eventually(reconciled, "ReconcileFailed=False once a pass succeeds", within=10)
        assert runtime.state.reconcile_failure is None
    finally:
        loop.cancel()
        with contextlib.suppress(asyncio.CancelledError):
            await loop
        await runtime.stop(unregister=False)
