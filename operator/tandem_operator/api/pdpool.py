"""The ``PDPool`` resource (short name ``pdp``): the scaling handle of one role of a PDCluster.

The operator creates one pool per role, ``<cluster>-prefill`` and ``<cluster>-decode``, owned by the PDCluster.
``spec.replicas`` (number of groups) is the single source of truth for the role's size after creation; it has
the scale subresource, so ``kubectl scale`` and HPAs work (``status.labelSelector`` selects all pods of the
role, ``status.replicas`` counts groups). The pod template is not copied here: it comes from the PDCluster, so
there is one place to change it. See ``tandem_operator.api.pdcluster`` for the rule in full.
"""

from __future__ import annotations

from pydantic import Field

from tandem.registry import Role
from tandem_operator.api.common import CONDITIONS_LIST, Condition
from tandem_operator.api.rules import CrdModel, immutable


class PDPoolSpec(CrdModel):
    """Desired size of one role of a PDCluster."""

    cluster_name: str = Field(min_length=1, max_length=253, json_schema_extra=immutable("clusterName is immutable"))
    role: Role = Field(json_schema_extra=immutable("role is immutable"))
    replicas: int = Field(ge=0, le=1000, description="Number of groups (each group: nodesPerGroup pods).")


class PDPoolStatus(CrdModel):
    """Observed groups of the role."""

    observed_generation: int = Field(default=0, ge=0)
    replicas: int = Field(default=0, ge=0, description="Groups that exist (any state).")
    ready_replicas: int = Field(default=0, ge=0)
    updated_replicas: int = Field(default=0, ge=0)
    label_selector: str = Field(default="", description="Selects every pod of the role (scale subresource).")
    template_hash: str = ""
    conditions: list[Condition] = Field(default_factory=list, max_length=16, json_schema_extra=CONDITIONS_LIST)
