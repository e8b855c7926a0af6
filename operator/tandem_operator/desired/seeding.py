"""Peer weight loading (``spec.peerLoading``, issue #35): where a created group's weights come from. Pure.

SGLang 0.5.23 loads a server's weights from a running one over Mooncake (``--load-format remote_instance
--remote-instance-weight-loader-backend transfer_engine`` with the seed's IP and HTTP port): each rank registers its
weight memory, asks the seed's HTTP server for the same TP rank's transfer-engine session and tensor addresses
(``/get_remote_instance_transfer_engine_info``), and reads its shard in one batch. A server is a seed when started
with ``--remote-instance-weight-loader-start-seed-via-transfer-engine`` *and* it read its weights itself: one that
loaded from a peer publishes nothing (``maybe_register_and_publish_weight_info``). A failed pull (the seed died,
its info is missing) is a ``RuntimeError`` and the server exits, with no retry and no fallback.

So the operator starts every pod with the seed flag and, for a group it creates whole, picks a seed (``choose_seed``)
among the role's serving groups that can seed (the planner's ``seed_pool``), at most ``maxLoadsPerSeed`` loads per
seed, else none (the node's copy). The choice is an incarnation's, like its epoch: it is recorded in the pod's
annotations (``weight_annotations``) and left out of the template hash, so it never reads as a rollout. An
incarnation that died loading from a peer (``died_loading_from_peer``) is followed by one that reads the node's copy.
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass
from typing import Any

from tandem_operator.desired.naming import ANNOTATION_WEIGHT_SEED, ANNOTATION_WEIGHT_SOURCE

SEED_FLAG = "--remote-instance-weight-loader-start-seed-via-transfer-engine"
# The flags of one incarnation's load from a peer: not part of a pod's revision (``desired.compare`` skips them).
PEER_FLAGS = (
    "--load-format",
    "--remote-instance-weight-loader-backend",
    "--remote-instance-weight-loader-seed-instance-ip",
    "--remote-instance-weight-loader-seed-instance-service-port",
)
FROM_NODE = "node"
FROM_PEER = "peer"


@dataclass(frozen=True)
class Seed:
    """A serving group a new group may pull its weights from."""

    index: int  # the seed group's index in its role
    group: str  # its name (its Service's), e.g. "c-decode-1"
    epoch: int  # its incarnation: a recreated seed is another seed
    ip: str  # its leader's pod IP, where its HTTP server answers the peers' rank queries
    port: int  # that HTTP server's port

    @property
    def ref(self) -> str:
        """How a peer's pods name it (``ANNOTATION_WEIGHT_SEED``)."""
        return f"{self.group}/{self.epoch}"


def peer_flags(seed: Seed) -> list[str]:
    """SGLang 0.5.23's flags that load from ``seed`` over the transfer engine (``arg_groups/model_path_hook.py``:
    without the IP or the port SGLang falls back to ``auto`` with a warning)."""
    return [
        "--load-format",
        "remote_instance",
        "--remote-instance-weight-loader-backend",
        "transfer_engine",
        "--remote-instance-weight-loader-seed-instance-ip",
        seed.ip,
        "--remote-instance-weight-loader-seed-instance-service-port",
        str(seed.port),
    ]


def weight_annotations(seed: Seed | None) -> dict[str, str]:
    """The pod annotations that say where its weights come from."""
    if seed is None:
        return {ANNOTATION_WEIGHT_SOURCE: FROM_NODE}
    return {ANNOTATION_WEIGHT_SOURCE: FROM_PEER, ANNOTATION_WEIGHT_SEED: seed.ref}


@dataclass(frozen=True)
class WeightSource:
    """Where a pod's weights came from, as its annotations say."""

    peer: bool
    seed: str = ""  # ``Seed.ref`` when ``peer``


def weight_source(pod: Mapping[str, Any]) -> WeightSource | None:
    """None for a pod made without peer loading (no annotation)."""
    annotations = (pod.get("metadata") or {}).get("annotations") or {}
    source = annotations.get(ANNOTATION_WEIGHT_SOURCE)
    if source is None:
        return None
    return WeightSource(source == FROM_PEER, str(annotations.get(ANNOTATION_WEIGHT_SEED, "")))


def can_seed(pods: Iterable[Mapping[str, Any]]) -> bool:
    """Every pod of the group read its weights itself (from the node), so the group publishes them."""
    sources = [weight_source(p) for p in pods]
    return bool(sources) and all(s is not None and not s.peer for s in sources)


def died_loading_from_peer(pods: Iterable[Mapping[str, Any]], registered: bool) -> bool:
    """A group that dies before it was ever registered while its pods load from a peer: the load failed or hung
    (the seed died mid-pull, or went away), so its next incarnation reads the node's copy."""
    return not registered and any((s := weight_source(p)) is not None and s.peer for p in pods)


def choose_seed(candidates: Sequence[Seed], loading: Mapping[str, int], limit: int) -> Seed | None:
    """The least loaded seed with fewer than ``limit`` loads in flight (the lowest index among equals); None: load
    from the node's copy."""
    free = [c for c in candidates if loading.get(c.ref, 0) < limit]
    return min(free, key=lambda c: (loading.get(c.ref, 0), c.index), default=None)
