"""Everything the operator knows about one PDCluster at run time, in one place (owned by ``reconcile.Reconciler``).

The fast fence path (``runtime``), the reconcile pass (``reconcile``) and the executor (``executor``) read this one
object, and change it only through the named transitions below (a grep for a transition's name finds every place
that moves the state that way); the pure deciders get plain values taken from it.
"""

from __future__ import annotations

from collections.abc import Collection, Iterable
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

    # -- transitions: the only writes to the state ---------------------------------------------------------------
    def spec_changed(self, spec: PDClusterSpec, generation: int) -> None:
        self.spec, self.generation = spec, generation

    def status_restored(self, conditions: Iterable[Condition], recoveries: int, last_recovery_s: float | None) -> None:
        """A new operator takes over the status its predecessor wrote (conditions, recovery counts)."""
        self.conditions = list(conditions)
        self.recoveries = max(self.recoveries, recoveries)
        self.last_recovery_s = self.last_recovery_s or last_recovery_s

    def conditions_written(self, conditions: list[Condition]) -> None:
        self.conditions = conditions

    def roll_trigger_seen(self, value: str | None) -> None:
        self.roll_trigger = value

    def pods_listed(self, pods: Iterable[Pod]) -> None:
        self.pods = {p["metadata"]["name"]: p for p in pods}

    def pod_seen(self, name: str, pod: Pod | None) -> None:
        """A pod event: its latest copy, or None once deleted."""
        if pod is None:
            self.pods.pop(name, None)
        else:
            self.pods[name] = pod

    def adopt(self, endpoints: dict[GroupKey, Endpoint]) -> None:
        """Entries a previous operator left in etcd, found at start."""
        self.adopted = endpoints

    def adoption_over(self) -> None:
        """The first registry sync put or removed every adopted entry."""
        self.adopted.clear()

    def registered_endpoint(self, key: GroupKey, endpoint: Endpoint) -> None:
        self.registered[key] = endpoint

    def unregistered(self, key: GroupKey) -> None:
        self.registered.pop(key, None)
        self.adopted.pop(key, None)

    def fenced_group(self, key: GroupKey, record: FenceRecord) -> None:
        """Fenced now, or found fenced (a Service's record) before this operator started."""
        self.fenced[key] = record

    def died_loading_from_peer(self, key: GroupKey, epoch: int) -> None:
        self.peer_load_failed[key] = epoch

    def fence_timed(self, timing: FenceTiming) -> None:
        self.fence_timings.append(timing)

    def recovered_group(self, key: GroupKey, seconds: float) -> None:
        """A fenced group registered again under a newer epoch: its fence is over."""
        del self.fenced[key]
        self.recoveries += 1
        self.last_recovery_s = round(seconds, 3)
        self.recovery_timings.append((key, seconds))

    def retired(self, key: GroupKey) -> None:
        """Being deleted on purpose (scale-down, rollout): unregistered, never fenced."""
        self.retiring.add(key)

    def drain_started(self, key: GroupKey, now: float) -> None:
        self.draining[key] = now

    def drain_ended(self, key: GroupKey) -> None:
        self.draining.pop(key, None)

    def going_away(self, key: GroupKey) -> None:
        """Its Service is deleted: a fence of it will never end in a recovery."""
        self.fenced.pop(key, None)

    def drain_abandoned(self, key: GroupKey) -> None:
        """Scaled back up while it drained: it serves again."""
        del self.draining[key]
        self.retiring.discard(key)

    def retired_gone(self, role: Role, remaining: Collection[int]) -> None:
        """Retiring groups of ``role`` whose pods are all gone are retiring no more."""
        self.retiring -= {k for k in self.retiring if k.role is role and k.index not in remaining}

    def integrity_listed(self, reports: dict[str, IntegrityReport]) -> None:
        self.integrity_reports = reports

    def pass_failed(self, failure: ReconcileFailure | None) -> ReconcileFailure | None:
        """Why the current pass failed (None: a pass begins, and writes False unless it fails); the previous."""
        before, self.reconcile_failure = self.reconcile_failure, failure
        return before
