"""Fabric locality of a (prefill, decode) pair, as a pure function.

A prefill sends its KV to the decode over RDMA; a pair inside one fabric domain (a rack behind one leaf, a rail
group, an NVLink domain) keeps the transfer off the spine. Each worker's domain comes from its registry entry (the
operator reads the PDCluster's ``spec.fabric.domainLabel`` on the group leader's node); a worker without one
(static or Kubernetes discovery, an older operator's entry, no fabric declared) is of unknown domain.

The mode comes from the router's ``--fabric-locality`` when set to ``preferred``, ``required`` or ``off``, else
(``auto``, the default) from the workers' registry entries (``spec.fabric.mode``): a pair is held to ``required``
when either of its workers' entries says so, else ``preferred``. A pair's tier:

- ``SAME`` (0): both workers in one domain; in ``preferred`` mode also a pair with a worker of unknown domain
  (compatible with every domain), and under ``off`` every pair;
- ``CROSS`` (1): two known, different domains in ``preferred`` mode: chosen only when no tier-0 pair is
  available and healthy;
- ``None``: not a pair at all: different or unknown domains in ``required`` mode.
"""

from __future__ import annotations

from enum import IntEnum, StrEnum


class FabricLocality(StrEnum):
    """``--fabric-locality``."""

    AUTO = "auto"  # the workers' registry entries say (PDCluster spec.fabric.mode); none: preferred
    PREFERRED = "preferred"
    REQUIRED = "required"
    OFF = "off"


class Locality(StrEnum):
    """Where a chosen pair's two workers are, relative to each other (the metric's bounded label)."""

    SAME = "same"
    CROSS = "cross"
    UNKNOWN = "unknown"  # at least one worker of unknown domain


class Tier(IntEnum):
    SAME = 0
    CROSS = 1


def locality(prefill_domain: str | None, decode_domain: str | None) -> Locality:
    if prefill_domain is None or decode_domain is None:
        return Locality.UNKNOWN
    return Locality.SAME if prefill_domain == decode_domain else Locality.CROSS


def required(setting: FabricLocality, prefill_required: bool, decode_required: bool) -> bool:
    """Whether the pair may only be formed within one domain (``*_required``: what each worker's entry says)."""
    if setting is FabricLocality.AUTO:
        return prefill_required or decode_required
    return setting is FabricLocality.REQUIRED


def pair_tier(
    setting: FabricLocality,
    prefill_domain: str | None,
    decode_domain: str | None,
    prefill_required: bool = False,
    decode_required: bool = False,
) -> Tier | None:
    """The pair's tier (lower wins), or None when the mode forbids the pair. See the module docstring."""
    if setting is FabricLocality.OFF:
        return Tier.SAME
    where = locality(prefill_domain, decode_domain)
    if where is Locality.SAME:
        return Tier.SAME
    if required(setting, prefill_required, decode_required):
        return None
    return Tier.SAME if where is Locality.UNKNOWN else Tier.CROSS
