"""Kubernetes Event types and reasons the operator reports (chosen by the pure planner, posted by ``k8s.events``)."""

from __future__ import annotations

from enum import StrEnum


class EventType(StrEnum):
    NORMAL = "Normal"
    WARNING = "Warning"


class Reason(StrEnum):
    FENCED = "Fenced"
    STALE_METADATA_REMOVED = "StaleMetadataRemoved"
    GROUP_RECREATING = "GroupRecreating"
    GROUP_READY = "GroupReady"
    REGISTERED = "Registered"
    UNROUTED = "Unrouted"  # a member NotReady: the group left rotation, keeps its pods and epoch
    SCALED_UP = "ScaledUp"
    SCALED_DOWN = "ScaledDown"
    ROLLOUT_STEP = "RolloutStep"
    NODE_CORDONED = "NodeCordoned"  # a member's node is cordoned: the group is drained, deleted and created elsewhere
    DRAINING = "Draining"
    DRAIN_TIMED_OUT = "DrainTimedOut"
    INVALID_SPEC = "InvalidSpec"
    PAIR_QUARANTINED = "PairQuarantined"
    PAIR_RELEASED = "PairReleased"
    INTEGRITY_RECREATE = "IntegrityRecreate"
    RECONCILE_FAILED = "ReconcileFailed"  # a pass failed: retried with backoff (decide/retry.py)
