"""Everything the operator knows about one PDCluster at run time, in one place (owned by ``reconcile.Reconciler``).

The fast fence path (``runtime``), the reconcile pass (``reconcile``) and the executor (``executor``) read and
write this one object; the pure deciders get plain values taken from it.
"""

from __future__ import annotations

from dataclasses import dataclass, field

from tandem.registry import Endpoint, IntegrityReport, Role
from tandem_operator.api.common import Condition
from tandem_operator.api.pdcluster import PDClusterSpec
from tandem_operator.decide.observe import GroupKey, Pod, group_of
from tandem_operator.decide.recovery import FenceRecord
from tandem_operator.decide.retry import ReconcileFailure
from tandem_operator.desired.naming import ClusterRef


@dataclass
class FenceTiming:
    """Measured for each fence (logged, and read by the live tests and the benchmark)."""

    group: GroupKey
    reason: str
    fenced_s: float  # event received -> endpoint key deleted
    cleaned_s: float  # event received -> stale Mooncake keys deleted
    stale_keys: int
    at: float  # monotonic


@dataclass
class ClusterState:
    ref: ClusterRef
    spec: PDClusterSpec
    generation: int = 0
    roll_trigger: str | None = None  # the PDCluster's tandem.dev/roll annotation (api/upgrade.py)
    conditions: list[Condition] = field(default_factory=list)
    pods: dict[str, Pod] = field(default_factory=dict)  # by name, from the last list plus every pod event
    registered: dict[GroupKey, Endpoint] = field(default_factory=dict)
    adopted: dict[GroupKey, Endpoint] = field(default_factory=dict)  # found in etcd at start (a previous operator's)
    fenced: dict[GroupKey, FenceRecord] = field(default_factory=dict)
    retiring: set[GroupKey] = field(default_factory=set)  # being deleted on purpose (scale-down, rollout)
    draining: dict[GroupKey, float] = field(default_factory=dict)  # retiring, pods not deleted yet -> since (monotonic)
    # the epoch of each group's last incarnation that died loading its weights from a peer (also on its Service)
    peer_load_failed: dict[GroupKey, int] = field(default_factory=dict)
    recoveries: int = 0
    last_recovery_s: float | None = None
    fence_timings: list[FenceTiming] = field(default_factory=list)
    recovery_timings: list[tuple[GroupKey, float]] = field(default_factory=list)
    # The routers' integrity reports (etcd key -> report); None until the watch has listed them once.
    integrity_reports: dict[str, IntegrityReport] | None = None
    reconcile_failure: ReconcileFailure | None = None  # why the last pass failed; None: it succeeded

    def members(self, group: GroupKey) -> list[Pod]:
        return [p for p in self.pods.values() if group_of(p) == group]

    def role_pods(self, role: Role) -> list[Pod]:
        return [p for p in self.pods.values() if (g := group_of(p)) is not None and g.role is role]
