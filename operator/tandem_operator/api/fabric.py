"""``PDCluster.spec.fabric``: the RDMA fabric domain a group lives in, and how routers pair across domains.

KV moves from a prefill to a decode over RDMA (Mooncake). A fabric domain -- a rack behind one leaf switch, a rail
group, an NVLink domain -- is named by a node label (``domainLabel``). The operator places every pod of a group in
one domain (required pod affinity among the group's ranks with that topology key, so only labelled nodes qualify),
registers each group with its leader's domain, and routers pair a prefill with a decode of the same domain first
(``Preferred``) or only (``Required``). ``topologyKey`` of a role, which pins a group's ranks to their leader's
label value, stays as it is: a zone is too coarse a domain, and it says nothing to routers.
"""

from __future__ import annotations

from enum import StrEnum
from typing import Annotated

from pydantic import Field, StringConstraints

from tandem.registry import FabricMode as RegistryFabricMode
from tandem_operator.api.rules import CrdModel

# A Kubernetes qualified label key: an optional DNS-subdomain prefix and '/', then a name of at most 63 characters
# (alphanumeric at both ends; '-', '_' and '.' inside).
_DNS_LABEL = r"[a-z0-9]([-a-z0-9]*[a-z0-9])?"
LABEL_KEY_PATTERN = rf"^({_DNS_LABEL}(\.{_DNS_LABEL})*/)?[A-Za-z0-9]([-A-Za-z0-9_.]{{0,61}}[A-Za-z0-9])?$"
QualifiedLabelKey = Annotated[str, StringConstraints(pattern=LABEL_KEY_PATTERN, max_length=317)]
HOSTNAME_LABEL = "kubernetes.io/hostname"


class FabricMode(StrEnum):
    PREFERRED = "Preferred"
    REQUIRED = "Required"

    def to_registry(self) -> RegistryFabricMode:
        """The mode as the registry entry carries it to routers."""
        return RegistryFabricMode.REQUIRED if self is FabricMode.REQUIRED else RegistryFabricMode.PREFERRED


class FabricSpec(CrdModel):
    """The RDMA fabric domain of the workers' nodes: every group's pods share one, and routers pair prefill and
    decode within one."""

    domain_label: QualifiedLabelKey = Field(
        description="Node label whose value names a node's RDMA fabric domain (a rack, rail group or NVLink "
        "domain; e.g. topology.example.com/rack). Every pod of a group is placed on nodes with one value of it "
        "(required pod affinity among the group's ranks; nodes without the label are not used), and each group is "
        "registered with its leader's value. Changing it rolls both roles.",
    )
    mode: FabricMode = Field(
        default=FabricMode.PREFERRED,
        description="Preferred: routers choose a pair within one domain whenever a healthy one exists, else any "
        "pair. Required: only pairs within one domain; a request with none gets a 503. Workers of unknown domain "
        "(older registry entries) pair with any in Preferred mode, with none in Required mode. Changing it rolls "
        "no pod.",
    )
