"""Where each new group of a role gets its weights, by the operator's own decision, and when it serves (issue #35).

The operator's pure functions decide: ``decide.planner.seed_pool`` (the role's serving, Ready, current groups that
read their weights themselves, and the peer loads in flight per seed) and ``decide.planner.steps`` (for each
``CreateGroup``, ``desired.seeding.choose_seed``: the least loaded seed under ``spec.peerLoading.maxLoadsPerSeed``,
else the node's copy). They run on the pods ``desired.pods.group_pod`` renders for ``deploy/kimi-k26-h200.yaml``
(with ``peerLoading`` on or off), marked Ready once a group serves; the source is read back from the created pods'
annotations (``desired.seeding.weight_source``). A group that loaded from a peer publishes nothing, so it never seeds.

When it serves is the caller's: a ``StartTimes`` per source. Not modelled: a seed's egress shared by its loads in
flight (each pull is timed as if alone: +3 s for the second of two 600 GB pulls at 190 GB/s), pod scheduling and
image pulls. Removal takes the newest group first (the operator takes a starting group, then the highest index).
"""

from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import yaml

from tandem.registry import Role
from tandem_operator.api.pdcluster import PDClusterSpec
from tandem_operator.decide.observe import GroupState, GroupView
from tandem_operator.decide.planner import Action, CreateGroup, CreatePods, Observed, seed_pool, steps
from tandem_operator.decide.recovery import stamp_epoch
from tandem_operator.desired.naming import ClusterRef, OwnerRef, group_name
from tandem_operator.desired.pods import RoleContext, group_pod
from tandem_operator.desired.seeding import Seed, weight_source
from tandem_sim.model.profiles import KIMI_LOAD
from tandem_sim.model.weights import LoadSettings, phases

RECIPE = Path(__file__).resolve().parents[1] / "deploy" / "kimi-k26-h200.yaml"
CLUSTER = ClusterRef("kimi-k26", "serving", "bench")


@dataclass(frozen=True)
class StartTimes:
    """Seconds from a group's creation to serving, per weight source."""

    node_s: float  # the node's copy (NVMe)
    peer_s: float  # a seed over Mooncake


@dataclass(frozen=True)
class Group:
    index: int
    ready_at: float  # when it serves
    seed: int | None  # the index of the group it loaded from; None: the node's copy


def modelled_times(spec: PDClusterSpec, role: Role) -> StartTimes:
    """``tandem_sim.model.weights.phases`` of the ``kimi-k2.6-h200`` profile (``KIMI_LOAD``) for the role's layout, plus
    the warm-up request. Every pod starts as a seed (the operator's ``SEED_FLAG``), so one that reads the node's copy
    also registers its weights; a prefill server captures no decode CUDA graphs."""
    layout = spec.role(role)

    def serving_s(peer: bool) -> float:
        load = LoadSettings(
            peer=peer,
            seed_url="http://seed:30000" if peer else "",
            start_seed=True,
            engine_info_bootstrap_port=6789,
            local_copy=True,
            cuda_graphs=role is Role.DECODE,
            weight_bytes_per_rank=1,
        )
        plan = phases(KIMI_LOAD, load, layout.tp_size, layout.gpus_per_node)
        return sum(p.seconds for p in plan) + KIMI_LOAD.server_warmup_s

    return StartTimes(node_s=serving_s(False), peer_s=serving_s(True))


def recipe_spec(peer_loading: bool) -> PDClusterSpec:
    """``deploy/kimi-k26-h200.yaml`` with ``spec.peerLoading.enabled`` as asked (``maxLoadsPerSeed`` its default)."""
    spec: dict[str, Any] = yaml.safe_load(RECIPE.read_text())["spec"]
    return PDClusterSpec.model_validate({**spec, "peerLoading": {"enabled": peer_loading}})


@dataclass
class Fleet:
    """One role's groups as the operator sees them; ``resize`` asks for a number of groups at a second."""

    ctx: RoleContext
    times: StartTimes
    groups: list[Group] = field(default_factory=list)

    @classmethod
    def build(cls, spec: PDClusterSpec, role: Role, times: StartTimes, serving: int) -> Fleet:
        """``serving`` groups that read the node's copy and serve from the start."""
        owner = OwnerRef("tandem.dev/v1alpha1", "PDPool", f"{CLUSTER.name}-{role.value}", "bench")
        return cls(RoleContext.build(CLUSTER, spec, role, owner), times, [Group(i, 0.0, None) for i in range(serving)])

    def ready(self, t: float) -> int:
        return sum(g.ready_at <= t for g in self.groups)

    def resize(self, t: float, desired: int) -> list[Group]:
        """The groups created at ``t`` (none on a scale-down: the newest go)."""
        del self.groups[desired:]
        if desired <= len(self.groups):
            return []
        views, pods = self._observed(t)
        taken = {g.index for g in self.groups}
        free = (i for i in range(desired + len(taken)) if i not in taken)
        creates: list[Action] = [CreateGroup(next(free)) for _ in range(desired - len(self.groups))]
        serving = frozenset(g.index for g in self.groups if g.ready_at <= t)
        seen = Observed(pods, {}, {}, frozenset(), seeds=seed_pool(self.ctx, views, pods, serving))
        made = [self._made(t, step) for step in steps(self.ctx, creates, views, seen)]
        self.groups += made
        return made

    def _made(self, t: float, step: object) -> Group:
        if not isinstance(step, CreatePods):
            raise TypeError(f"a CreateGroup planned {step!r}")
        leader = next(m for m in step.manifests if m["kind"] == "Pod")
        source = weight_source(leader)
        if source is None or not source.peer:
            return Group(step.group.index, t + self.times.node_s, None)
        seed = next(
            g.index for g in self.groups if f"{group_name(CLUSTER.name, self.ctx.role, g.index)}/0" == source.seed
        )
        return Group(step.group.index, t + self.times.peer_s, seed)

    def _observed(self, t: float) -> tuple[dict[int, GroupView], dict[str, dict[str, Any]]]:
        """The pods of every group, rendered as the operator made them (the seed in their annotations), Ready and
        with an IP once the group serves; a group's leader IP is 10.0.<index>.1."""
        views: dict[int, GroupView] = {}
        pods: dict[str, dict[str, Any]] = {}
        port = self.ctx.spec.role(self.ctx.role).ports.http
        for g in self.groups:
            loaded_from = None
            if g.seed is not None:
                loaded_from = Seed(g.seed, group_name(CLUSTER.name, self.ctx.role, g.seed), 0, _ip(g.seed), port)
            serving = g.ready_at <= t
            members = []
            for rank in range(self.ctx.spec.role(self.ctx.role).nodes_per_group):
                pod = stamp_epoch(group_pod(self.ctx, g.index, rank, 0, loaded_from), 0)
                ready = [{"type": "Ready", "status": "True"}] if serving else []
                pod["status"] = {"phase": "Running", "podIP": _ip(g.index, rank), "conditions": ready}
                members.append(pod)
            pods.update({p["metadata"]["name"]: p for p in members})
            state = GroupState.READY if serving else GroupState.STARTING
            names = tuple(sorted(p["metadata"]["name"] for p in members))
            views[g.index] = GroupView(g.index, state, self.ctx.template_hash, names)
        return views, pods


def _ip(index: int, rank: int = 0) -> str:
    return f"10.0.{index}.{rank + 1}"


def scale_out(times: StartTimes, peer_loading: bool, start: int = 1, target: int = 4) -> list[Group]:
    """Decode ``start`` -> ``target`` in one step at 0 s, ``start`` groups serving: the groups created."""
    fleet = Fleet.build(recipe_spec(peer_loading), Role.DECODE, times, start)
    return fleet.resize(0.0, target)
