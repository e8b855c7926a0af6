"""Node labels the operator reads and writes.

``NodeDomains``: the fabric domain of the nodes group leaders run on (``spec.fabric.domainLabel``), read from their
Node objects. One GET per node, the first time a leader is seen on it; the answer is kept while a leader of the
cluster runs there (the label places the pod: a relabelled node does not move running pods either), so a pass
registers with no request once the leaders are known, and a PDCluster without ``spec.fabric`` asks for nothing.

``StagedNodes``: the nodes holding a staged copy of the weights (``decide.staging``), labelled by the operator.
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Collection, Mapping
from typing import Any

from tandem_operator.act.k8s.kube import Kube, KubeError, PermanentError
from tandem_operator.decide.staging import node_staged_labels
from tandem_operator.desired.fabric import node_domain
from tandem_operator.desired.naming import STAGED_VALUE

log = logging.getLogger("tandem.operator")

PARALLEL_GETS = 8


class NodeDomains:
    def __init__(self, kube: Kube) -> None:
        self.kube = kube
        self._label = ""
        self._known: dict[str, str | None] = {}  # node -> its domain (None: unlabelled or gone)

    async def resolve(self, label: str, nodes: Collection[str]) -> dict[str, str]:
        """The domain of each of ``nodes`` that has one (a node not named here is unknown to the registry)."""
        if label != self._label:  # another label: nothing known holds
            self._label, self._known = label, {}
        wanted = set(nodes)
        for gone in self._known.keys() - wanted:
            del self._known[gone]
        gate = asyncio.Semaphore(PARALLEL_GETS)

        async def read(node: str) -> None:
            async with gate:
                self._known[node] = node_domain(await self.kube.get(f"/api/v1/nodes/{node}"), label)

        await asyncio.gather(*(read(node) for node in sorted(wanted - self._known.keys())))
        return {node: domain for node in wanted if (domain := self._known.get(node)) is not None}


class StagedNodes:
    """Each node's staged-weights labels and label keys (``decide.staging``): kept from the node watch
    (``observe``), and set by the reconcile with one merge patch per node (``label``), whose answer is recorded at
    once so the next pass does not patch again before the watch delivers it.

    A refused patch (the operator's ClusterRole lacks ``patch`` on nodes) is logged once per node and label and not
    retried: pods then get no preference for staged nodes, nothing else changes.
    """

    def __init__(self, kube: Kube) -> None:
        self.kube = kube
        self.labels: dict[str, frozenset[str]] = {}  # node -> its staged-weights labels
        self.keys: dict[str, frozenset[str]] | None = None  # node -> its label keys; None until the watch reports
        self._refused: set[tuple[str, str]] = set()

    def observe(self, event_type: str, node: Mapping[str, Any]) -> None:
        name = str((node.get("metadata") or {}).get("name", ""))
        keys = self.keys if self.keys is not None else {}
        if event_type == "DELETED":
            self.labels.pop(name, None)
            keys.pop(name, None)
        elif name:
            self.labels[name] = node_staged_labels(node)
            keys[name] = frozenset((node.get("metadata") or {}).get("labels") or {})
        self.keys = keys

    async def label(self, node: str, label: str) -> None:
        if (node, label) in self._refused:
            return
        patch = {"metadata": {"labels": {label: STAGED_VALUE}}}
        try:
            patched = await self.kube.merge_patch(f"/api/v1/nodes/{node}", patch)
        except PermanentError as err:
            self._refused.add((node, label))
            log.warning("cannot label node as holding the weights", extra={"node": node, "error": str(err)})
            return
        except KubeError as err:  # temporary: the next pass tries again
            log.warning("labelling node failed", extra={"node": node, "error": str(err)})
            return
        if patched is not None:  # None: the node is gone
            self.labels[node] = node_staged_labels(patched)
