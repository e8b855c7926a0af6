"""The fabric domain of the nodes group leaders run on (``spec.fabric.domainLabel``), read from their Node objects.

One GET per node, the first time a leader is seen on it; the answer is kept while a leader of the cluster runs
there (the label places the pod: a relabelled node does not move running pods either), so a pass registers
with no request once the leaders are known, and a PDCluster without ``spec.fabric`` asks for nothing.
"""

from __future__ import annotations

import asyncio
from collections.abc import Collection

from tandem_operator.act.k8s.kube import Kube
from tandem_operator.desired.fabric import node_domain

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
