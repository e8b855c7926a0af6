"""kopf handlers: thin. They translate Kubernetes events into calls on ``OperatorState`` / ``ClusterRuntime``.

Built on an explicit ``kopf.OperatorRegistry`` (no module-level globals), so ``main`` and the tests each get
their own. PDCluster create/update/resume -> validate, apply the PDPools, (re)start the cluster's runtime; pods
(label ``tandem.dev/cluster`` present) -> the fast fence path; PDPools -> a reconcile kick (``kubectl scale``);
nodes -> their outages (``fencing.node_outage``), which each cluster's runtime weighs against its grace, their
cordons (``fencing.node_cordoned``), which each cluster's planner moves groups off, and their staged-weights labels
(``decide.staging``), which each cluster's reconcile sets and counts.
"""

from __future__ import annotations

import logging
from collections.abc import Sequence
from dataclasses import dataclass, field
from datetime import UTC, datetime
from typing import Any

import kopf
import pydantic

from tandem.registry import EtcdTLS
from tandem.registry_signing import EndpointSigner
from tandem_operator.act.k8s.kube import Kube
from tandem_operator.act.k8s.nodes import StagedNodes
from tandem_operator.act.registrar import Registrar
from tandem_operator.api.common import GROUP, VERSION
from tandem_operator.api.pdcluster import EtcdSpec, PDClusterSpec
from tandem_operator.api.upgrade import ANNOTATION_ROLL
from tandem_operator.decide.fencing import NodeOutage, node_cordoned, node_outage
from tandem_operator.desired.naming import LABEL_CLUSTER, ClusterRef
from tandem_operator.run.runtime import ClusterRuntime, RuntimeOptions

log = logging.getLogger("tandem.operator")


@dataclass
class OperatorState:
    kube: Kube
    options: RuntimeOptions
    etcd_override: Sequence[str] = ()  # the operator's own route to etcd, if it differs from the spec's
    lease_ttl: int = 10
    etcd_tls: EtcdTLS | None = None  # client certificate of the operator's etcd user (tandem.etcd_auth)
    signer: EndpointSigner | None = None  # signs every registry value (routers verify: tandem.registry_signing)
    runtimes: dict[tuple[str, str], ClusterRuntime] = field(default_factory=dict)
    registrars: dict[tuple[str, ...], Registrar] = field(default_factory=dict)
    node_outages: dict[str, NodeOutage] = field(default_factory=dict)  # nodes not Ready (deleted or NotReady)
    cordoned: set[str] = field(default_factory=set)  # nodes with spec.unschedulable
    staged: StagedNodes = field(init=False)  # nodes' staged-weights labels (decide.staging), from the node watch

    def __post_init__(self) -> None:
        self.staged = StagedNodes(self.kube)

    async def registrar(self, etcd: EtcdSpec) -> Registrar:
        endpoints, mooncake = tuple(self.etcd_override or etcd.endpoints), tuple(etcd.mooncake_endpoints)
        key = (*endpoints, "|", *mooncake)
        if key not in self.registrars:
            registrar = Registrar(
                endpoints, ttl=self.lease_ttl, tls=self.etcd_tls, signer=self.signer, mooncake_endpoints=mooncake
            )
            await registrar.start()
            self.registrars[key] = registrar
        return self.registrars[key]

    async def ensure_runtime(self, ref: ClusterRef, spec: PDClusterSpec) -> ClusterRuntime:
        key = (ref.namespace, ref.name)
        runtime = self.runtimes.get(key)
        if runtime is not None and runtime.ref.uid != ref.uid:  # deleted and recreated under the same name
            await runtime.stop(unregister=False)
            runtime = None
        if runtime is None:
            registrar = await self.registrar(spec.etcd)
            outages, cordoned = (lambda: self.node_outages), (lambda: frozenset(self.cordoned))
            runtime = ClusterRuntime(ref, spec, self.kube, registrar, self.options, outages, cordoned, self.staged)
            self.runtimes[key] = runtime
            await runtime.start()
        return runtime

    async def close(self) -> None:
        for runtime in self.runtimes.values():
            await runtime.stop(unregister=False)
        for registrar in self.registrars.values():
            await registrar.close()


def parse_spec(spec: Any) -> PDClusterSpec:
    """The PDCluster spec as the model; a spec the API server let through but the model rejects is permanent."""
    try:
        return PDClusterSpec.model_validate(dict(spec))
    except pydantic.ValidationError as err:
        raise kopf.PermanentError(f"invalid PDCluster spec: {err}") from err


def build_registry(state: OperatorState) -> kopf.OperatorRegistry:
    registry = kopf.OperatorRegistry()

    @kopf.on.resume(GROUP, VERSION, "pdclusters", registry=registry)
    @kopf.on.create(GROUP, VERSION, "pdclusters", registry=registry)
    @kopf.on.update(GROUP, VERSION, "pdclusters", field="spec", registry=registry)
    async def cluster_changed(body: kopf.Body, spec: kopf.Spec, meta: kopf.Meta, status: kopf.Status, **_: Any) -> None:
        ref = ClusterRef(name=str(meta["name"]), namespace=str(meta["namespace"]), uid=str(meta["uid"]))
        model = parse_spec(spec)
        runtime = await state.ensure_runtime(ref, model)
        await runtime.reconciler.apply_pools()
        runtime.set_roll_trigger((meta.get("annotations") or {}).get(ANNOTATION_ROLL))
        runtime.update(model, int(meta.get("generation") or 0), dict(status))

    @kopf.on.event(GROUP, VERSION, "pdclusters", registry=registry)
    async def cluster_event(event: kopf.RawEvent, **_: Any) -> None:
        meta = event["object"]["metadata"]
        if event["type"] != "DELETED":
            known = state.runtimes.get((meta["namespace"], meta["name"]))
            if known is not None and known.ref.uid == meta.get("uid"):
                known.set_roll_trigger((meta.get("annotations") or {}).get(ANNOTATION_ROLL))
            return
        runtime = state.runtimes.pop((meta["namespace"], meta["name"]), None)
        if runtime is not None:
            await runtime.stop(unregister=True)
            log.info("cluster deleted; endpoints removed", extra={"cluster": f"{meta['namespace']}/{meta['name']}"})

    @kopf.on.event(GROUP, VERSION, "pdpools", registry=registry)
    async def pool_event(body: kopf.Body, **_: Any) -> None:
        runtime = state.runtimes.get((str(body.metadata.namespace), str(body.spec.get("clusterName", ""))))
        if runtime is not None:
            runtime.kick()

    @kopf.on.event("", "v1", "pods", labels={LABEL_CLUSTER: kopf.PRESENT}, registry=registry)
    async def pod_event(event: kopf.RawEvent, **_: Any) -> None:
        pod = event["object"]
        meta = pod.get("metadata") or {}
        runtime = state.runtimes.get((meta.get("namespace", ""), (meta.get("labels") or {}).get(LABEL_CLUSTER, "")))
        if runtime is not None:
            await runtime.on_pod_event(str(event["type"]), pod)

    @kopf.on.event("", "v1", "nodes", registry=registry)
    async def node_event(event: kopf.RawEvent, **_: Any) -> None:
        node = event["object"]
        name = str((node.get("metadata") or {}).get("name", ""))
        state.staged.observe(str(event["type"]), node)
        if node_cordoned(str(event["type"]), node) != (name in state.cordoned):
            cordoned = name not in state.cordoned
            (state.cordoned.add if cordoned else state.cordoned.discard)(name)
            log.warning("node cordoned" if cordoned else "node uncordoned", extra={"node": name})
            for runtime in list(state.runtimes.values()):
                runtime.kick()  # the planner moves the groups off a cordoned node
        previous = state.node_outages.get(name)
        outage = node_outage(str(event["type"]), node, datetime.now(UTC), previous)
        if outage == previous:
            return
        if outage is None:
            del state.node_outages[name]
            log.warning("node Ready again", extra={"node": name})
        else:
            state.node_outages[name] = outage
            what = "node deleted" if outage.gone else "node NotReady"
            log.warning(what, extra={"node": name, "since": outage.since.isoformat()})
        for runtime in list(state.runtimes.values()):
            await runtime.on_nodes_changed({name})

    @kopf.on.cleanup(registry=registry)
    async def cleanup(**_: Any) -> None:
        await state.close()

    return registry
