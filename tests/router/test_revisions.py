"""Revision-coherent pairs: the router pairs a prefill and a decode only when their compatibility revisions are
equal, from every discovery source, and exports the pairs it may choose and dispatches by revision."""

from __future__ import annotations

from prometheus_client import generate_latest

from tandem.registry import Endpoint, Role
from tandem_router.discovery import pod_spec
from tandem_router.discovery_etcd import endpoint_spec
from tandem_router.metrics import RouterMetrics
from tandem_router.pool import Pair, WorkerPool, WorkerSpec


def _spec(role: Role, n: int, revision: str) -> WorkerSpec:
    return WorkerSpec(role, f"http://10.0.{0 if role is Role.PREFILL else 1}.{n}:30000", 8998, revision=revision)


def test_only_equal_revisions_pair_during_a_rollout() -> None:
    pool = WorkerPool()
    pool.replace_all(
        [
            _spec(Role.PREFILL, 0, "old"),
            _spec(Role.PREFILL, 1, "new"),
            _spec(Role.DECODE, 0, "old"),
            _spec(Role.DECODE, 1, "new"),
        ]
    )
    chosen = [pool.choose_pair(f"{i}: a prompt", 0.0) for i in range(50)]
    pairs = {(p.prefill.revision, p.decode.revision) for p in chosen if p is not None}
    assert pairs == {("old", "old"), ("new", "new")}
    pool.remove(_spec(Role.DECODE, 1, "new").key)  # the new decode not up yet: new prefills get nothing
    for i in range(20):
        pair = pool.choose_pair(f"x{i}", 0.0)
        assert pair is not None
        assert pair.prefill.revision == pair.decode.revision == "old"
    pool.remove(_spec(Role.DECODE, 0, "old").key)
    assert pool.choose_pair("y", 0.0) is None  # never across revisions, even with nothing else left


def test_discovery_keeps_the_revision() -> None:
    endpoint = Endpoint(
        role=Role.DECODE, group="decode-0", url="http://10.0.0.1:30001", model="m", revision="abc123", epoch=2
    )
    assert endpoint_spec(endpoint).revision == "abc123"
    pod = {
        "metadata": {"name": "p", "labels": {"tandem.dev/revision": "abc123"}},
        "status": {"phase": "Running", "podIP": "10.0.0.2", "conditions": [{"type": "Ready", "status": "True"}]},
    }
    spec = pod_spec(pod, Role.DECODE, 30001)
    assert spec is not None
    assert spec.revision == "abc123"


def test_pairs_metric_by_revision() -> None:
    pool = WorkerPool()
    specs = [_spec(Role.PREFILL, 0, "old"), _spec(Role.DECODE, 0, "old"), _spec(Role.DECODE, 1, "new")]
    specs.append(_spec(Role.PREFILL, 1, "new"))
    pool.replace_all(specs)
    metrics = RouterMetrics(pool)
    metrics.dispatched(Pair(specs[0], specs[1]))
    text = generate_latest(metrics.registry).decode()
    assert 'tandem_router_pairs{revision="old"} 1.0' in text
    assert 'tandem_router_pairs{revision="new"} 1.0' in text
    assert 'tandem_router_pair_dispatches_total{decode_revision="old",prefill_revision="old"} 1.0' in text
