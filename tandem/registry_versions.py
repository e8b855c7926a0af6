"""Registry schema versions: which registry values a reader of this version uses, and what a writer promises.

Every value carries its schema version in the member ``schema_version``; a value without one was written before
versions existed and is version 1 (``LEGACY_VERSION``). Writers stamp ``SCHEMA_VERSION`` (N). A reader of version N
uses values of versions N-1, N and N+1 and refuses the rest:

- **One back (N-1)**: members the older writer did not know take their defaults.
- **One ahead (N+1)**: the writer of version N+1 promises that a reader of version N routes correctly with it. So
  version N+1 only *adds* members, each optional (a reader that ignores it is right, only less informed), and
  writes every member a version-N writer would write for the same endpoint, with the same meaning and the same
  JSON encoding; it never removes, renames or retypes a member, nor changes what a value of one means. A reader
  ignores the members it does not know (they are kept, and covered by the signature, see below).
- **A breaking change bumps the version by 2** (N+2), so a reader of version N refuses those values instead of
  misreading them, and routers must be upgraded first (within one version, routers and operator upgrade in either
  order).
- **Refused** (that key only: its worker is handled as if the key were absent, other keys are unaffected): a
  version two or more ahead (``too_new``) or more than one back (``too_old``); a version member that is not a
  positive integer, a value that is not a JSON object (or has a member twice, or a NaN), a member this version knows
  with an invalid value, a version-1 value with members version 1 never had (``invalid``).

Signatures (``tandem.registry_signing``): from version 2 on, the operator signs the registry key and the canonical
JSON (``canonical``: keys sorted, no whitespace) of the *whole* stored object but its ``signature`` member, members
this reader does not know included, so an unknown member cannot be added or changed without breaking the signature:
what a newer router would read from it is what the operator signed. Every later version keeps that rule (it is what
lets a version-N router verify a version N+1 value). Version 1 values keep their own payload (the members version 1
knows, as ``tandem.registry.signed_payload`` writes them), which is why unknown members are refused in them.

Pure: no I/O.
"""

from __future__ import annotations

import json
from collections import Counter
from collections.abc import Mapping
from enum import StrEnum
from typing import Any

SCHEMA_VERSION = 2
LEGACY_VERSION = 1  # values written before versions existed: no version member
OLDEST_READ = SCHEMA_VERSION - 1
NEWEST_READ = SCHEMA_VERSION + 1
VERSION_MEMBER = "schema_version"


class Relation(StrEnum):
    """How a value's version relates to this reader's: the label of ``tandem_router_registry_entries_by_schema``."""

    OLDER = "older"
    CURRENT = "current"
    NEWER = "newer"
    UNSUPPORTED = "unsupported"  # refused: too new, too old, or not a valid value


class Refusal(StrEnum):
    TOO_NEW = "too_new"
    TOO_OLD = "too_old"
    INVALID = "invalid"


class EntryRefusedError(ValueError):
    """A registry value this reader does not use, with why (``reason``, bounded) and the detail."""

    def __init__(self, reason: Refusal, detail: str, version: int | None = None) -> None:
        super().__init__(f"{reason.value}: {detail}")
        self.reason, self.detail, self.version = reason, detail, version


def relation(version: int) -> Relation:
    if version < OLDEST_READ or version > NEWEST_READ:
        return Relation.UNSUPPORTED
    if version < SCHEMA_VERSION:
        return Relation.OLDER
    return Relation.CURRENT if version == SCHEMA_VERSION else Relation.NEWER


def read_object(value: bytes) -> tuple[int, dict[str, Any]]:
    """A stored value's version and members; raises ``EntryRefusedError`` for a version this reader does not use or a
    value that is not one JSON object with unique member names, finite numbers and a positive integer version."""
    try:
        obj = json.loads(value, object_pairs_hook=_unique_members, parse_constant=_no_constant)
    except (ValueError, RecursionError) as err:  # JSONDecodeError and UnicodeDecodeError are ValueErrors
        raise EntryRefusedError(Refusal.INVALID, f"not JSON: {err}") from err
    if not isinstance(obj, dict):
        raise EntryRefusedError(Refusal.INVALID, f"not a JSON object but {type(obj).__name__}")
    version = obj.get(VERSION_MEMBER, LEGACY_VERSION)
    if type(version) is not int or version < 1:  # bool is an int subclass: refused too
        raise EntryRefusedError(Refusal.INVALID, f"{VERSION_MEMBER} must be a positive integer, got {version!r}")
    if version > NEWEST_READ:
        raise EntryRefusedError(
            Refusal.TOO_NEW, f"schema version {version}, this reader reads {OLDEST_READ} to {NEWEST_READ}", version
        )
    if version < OLDEST_READ:
        raise EntryRefusedError(
            Refusal.TOO_OLD, f"schema version {version}, this reader reads {OLDEST_READ} to {NEWEST_READ}", version
        )
    return version, obj


def _unique_members(pairs: list[tuple[str, Any]]) -> dict[str, Any]:
    obj = dict(pairs)
    if len(obj) != len(pairs):
        twice = sorted(name for name, n in Counter(name for name, _ in pairs).items() if n > 1)
        raise ValueError(f"a member appears twice: {twice}")
    return obj


def _no_constant(name: str) -> float:
    raise ValueError(f"{name} is not JSON")


def canonical(obj: Mapping[str, Any]) -> bytes:
    """The signed form of a stored object: JSON with sorted keys, no whitespace, ASCII only."""
    return json.dumps(obj, sort_keys=True, separators=(",", ":"), ensure_ascii=True, allow_nan=False).encode()


class SchemaCensus:
    """What one reader made of a registry prefix: each key's relation now, and the values it refused so far."""

    def __init__(self) -> None:
        self.by_key: dict[str, Relation] = {}
        self.refused: Counter[Refusal] = Counter()

    def counts(self) -> dict[Relation, int]:
        """Entries by relation, every relation present (0 when none)."""
        counts = dict.fromkeys(Relation, 0)
        for rel in self.by_key.values():
            counts[rel] += 1
        return counts
