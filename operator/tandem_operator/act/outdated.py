"""The thin adapter of ``upgrade.py``: what it decided, done against Kubernetes.

It stamps current groups' pods with the PDCluster generation, reads one live pod per outdated role to say what
would change (``desired.compare.drift``: the slim pods the operator keeps have no container), and removes the
``tandem.dev/roll`` annotation once the roles it names have rolled.
"""

from __future__ import annotations

import logging
from collections.abc import Iterable

from tandem.registry import Role
from tandem_operator.act.executor import bounded
from tandem_operator.act.k8s.apply import object_path
from tandem_operator.act.k8s.kube import Kube
from tandem_operator.api.common import API_VERSION
from tandem_operator.api.upgrade import ANNOTATION_ROLL
from tandem_operator.decide.observe import GroupView, Pod, pod_facts
from tandem_operator.decide.upgrade import stamps
from tandem_operator.desired.compare import drift
from tandem_operator.desired.naming import LABEL_TEMPLATE_HASH, ClusterRef
from tandem_operator.desired.pods import RoleContext, group_pod

log = logging.getLogger("tandem.operator")


class OutdatedPods:
    def __init__(self, kube: Kube, ref: ClusterRef) -> None:
        self.kube, self.ref = kube, ref
        # per role: (pod, its template hash, the desired one) and what would change (pods are immutable: one GET)
        self._changes: dict[Role, tuple[tuple[str, str, str], list[str]]] = {}

    async def stamp(self, names: Iterable[str], generation: int, template_hash: str) -> None:
        """Annotate pods with ``upgrade.stamps`` (a metadata patch: the pods keep running)."""
        patch = {"metadata": {"annotations": stamps(generation, template_hash)}}
        paths = [object_path({"apiVersion": "v1", "kind": "Pod", "metadata": self._meta(n)}) for n in names]
        await bounded([self.kube.merge_patch(path, patch) for path in paths])

    async def changes(self, ctx: RoleContext, view: GroupView, pods: dict[str, Pod]) -> list[str]:
        """What the operator would change in the group's leader (a view of an outdated group), from the live pod."""
        leader = next((f for f in (pod_facts(pods.get(n) or {}) for n in view.pods) if f and f.rank == 0), None)
        if leader is None:
            return []
        live_hash = ((pods[leader.name].get("metadata") or {}).get("labels") or {}).get(LABEL_TEMPLATE_HASH, "")
        key = (leader.name, live_hash, ctx.template_hash)
        known = self._changes.get(ctx.role)
        if known is not None and known[0] == key:
            return known[1]
        live = await self.kube.get(
            object_path({"apiVersion": "v1", "kind": "Pod", "metadata": self._meta(leader.name)})
        )
        if live is None:
            return []
        changes = drift(live, group_pod(ctx, view.index, 0, leader.epoch))
        self._changes[ctx.role] = (key, changes)
        return changes

    async def clear_trigger(self, value: str) -> None:
        """Remove the roll annotation (a merge patch: the spec, hence the generation, is untouched)."""
        path = object_path({"apiVersion": API_VERSION, "kind": "PDCluster", "metadata": self._meta(self.ref.name)})
        await self.kube.merge_patch(path, {"metadata": {"annotations": {ANNOTATION_ROLL: None}}})
        log.info("roll trigger done", extra={"cluster": self.ref.name, ANNOTATION_ROLL: value})

    def _meta(self, name: str) -> dict[str, str]:
        return {"name": name, "namespace": self.ref.namespace}
