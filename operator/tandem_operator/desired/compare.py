"""What differs between two renderings of a worker pod, in words: image, flags, env, other fields. Pure.

Used where a pod's revision (``naming.template_hash``) changed without the user changing the spec: the PDCluster's
``PodsOutdated`` condition says what the operator would now run differently (``upgrade.py``), and the release
golden test says which pods of the ``deploy/`` examples an upgrade from the previous release would roll, and why.

A live pod carries fields the API server defaulted (probe thresholds, ``terminationMessagePath``, quantities in
canonical form): only the fields the operator renders are compared, and a field it renders is compared as a
subset of the live one.
"""

from __future__ import annotations

import hashlib
import json
from collections.abc import Mapping
from typing import Any

from tandem_operator.desired.seeding import PEER_FLAGS

# Compared one by one (they say why a pod changed); every other field of the container or the pod as a whole.
_DETAILED = ("image", "args", "env")


def worker_container(pod: Mapping[str, Any]) -> Mapping[str, Any]:
    """The SGLang container (the pod's first; prefetch steps are init containers)."""
    containers = (pod.get("spec") or {}).get("containers") or [{}]
    return containers[0] or {}


def _env_value(var: Mapping[str, Any]) -> str:
    if "value" in var:
        return str(var["value"])
    source = dict(var.get("valueFrom") or {})
    if (source.get("fieldRef") or {}).get("apiVersion") == "v1":  # the API server's default
        source["fieldRef"] = {k: v for k, v in source["fieldRef"].items() if k != "apiVersion"}
    return "valueFrom " + json.dumps(source, sort_keys=True, separators=(",", ":"))


def container_view(pod: Mapping[str, Any]) -> dict[str, Any]:
    """The worker container's image, arguments (command first, if any) and environment (name -> value)."""
    container = worker_container(pod)
    return {
        "image": str(container.get("image", "")),
        "args": [str(a) for a in (*(container.get("command") or ()), *(container.get("args") or ()))],
        "env": {str(var.get("name")): _env_value(var) for var in container.get("env") or ()},
    }


def _digest(value: Any) -> str:
    return hashlib.sha256(json.dumps(value, sort_keys=True, separators=(",", ":")).encode()).hexdigest()[:10]


def field_digests(pod: Mapping[str, Any]) -> dict[str, str]:
    """A digest of each other field of the worker container (``container.<field>``), of the pod spec
    (``spec.<field>``) and of its labels and annotations (``metadata.<field>``), so two renderings tell which of them
    differ without keeping them whole. Give it a ``naming.canonical_pod``."""
    spec, metadata = pod.get("spec") or {}, pod.get("metadata") or {}
    fields = {f"container.{k}": _digest(v) for k, v in worker_container(pod).items() if k not in (*_DETAILED, "name")}
    fields.update({f"spec.{k}": _digest(v) for k, v in spec.items() if k != "containers"})
    fields.update({f"metadata.{k}": _digest(v) for k, v in metadata.items() if v})
    return dict(sorted(fields.items()))


def _flags(args: list[str]) -> dict[str, str]:
    """``--flag value`` and ``--flag=value`` by flag (a bare flag has the value ""; repeats are joined); the words
    before the first flag by position. An incarnation's peer-loading flags (``seeding.PEER_FLAGS``: which seed it
    pulled from) are no difference of rendering and are left out."""
    flags: dict[str, str] = {}
    key: str | None = None
    for position, arg in enumerate(args):
        if arg.startswith("--"):
            name, _, value = arg.partition("=")
            flags[name] = f"{flags[name]} {value}".strip() if name in flags else value
            key = None if value else name
        elif key is not None:
            flags[key] = f"{flags[key]} {arg}".strip()
            key = None
        else:
            flags[f"[{position}]"] = arg
    return {name: value for name, value in flags.items() if name not in PEER_FLAGS}


def _mapping_changes(what: str, old: Mapping[str, str], new: Mapping[str, str]) -> list[str]:
    changes = [f"{what} added {k}{'=' + new[k] if new[k] else ''}" for k in new if k not in old]
    changes += [f"{what} removed {k}" for k in old if k not in new]
    changes += [f"{what} {k}: {old[k]!r} -> {new[k]!r}" for k in new if k in old and old[k] != new[k]]
    return changes


def differences(old: Mapping[str, Any], new: Mapping[str, Any]) -> list[str]:
    """What changes from container view ``old`` to ``new`` (``container_view``), one line per image, flag or env
    variable."""
    changes = [f"image {old['image']} -> {new['image']}"] if old["image"] != new["image"] else []
    changes += _mapping_changes("flag", _flags(old["args"]), _flags(new["args"]))
    changes += _mapping_changes("env", old["env"], new["env"])
    return changes


def field_changes(old: Mapping[str, str], new: Mapping[str, str]) -> list[str]:
    """The other fields (``field_digests``) that changed, were added or went."""
    names = sorted({*old, *new})
    return [
        f"{name} {'added' if name not in old else 'removed' if name not in new else 'changed'}"
        for name in names
        if old.get(name) != new.get(name)
    ]


def _covers(live: Any, desired: Any) -> bool:
    """``desired`` is in ``live``: equal, or a mapping whose every key ``live`` has with a covering value (the API
    server adds defaults), or a list of as many items, each covered; a list of named items (volumes, mounts,
    ports) by name, since admission adds its own (the service account token's volume and mount)."""
    if isinstance(desired, Mapping) and isinstance(live, Mapping):
        return all(k in live and _covers(live[k], v) for k, v in desired.items())
    if isinstance(desired, list) and isinstance(live, list):
        if desired and all(isinstance(d, Mapping) and "name" in d for d in desired):  # volumes, mounts, ports
            by_name = {item.get("name"): item for item in live if isinstance(item, Mapping)}
            return all(d["name"] in by_name and _covers(by_name[d["name"]], d) for d in desired)
        return len(desired) == len(live) and all(_covers(a, b) for a, b in zip(live, desired, strict=True))
    return bool(live == desired)


def drift(live: Mapping[str, Any], desired: Mapping[str, Any]) -> list[str]:
    """What the operator would render differently from the running pod ``live``: the worker container's image, flags
    and env exactly, every other field the operator renders (container and pod spec) when the live one lacks it."""
    changes = differences(container_view(live), container_view(desired))
    live_container, want_container = worker_container(live), worker_container(desired)
    changes += [
        f"container.{k} changed"
        for k, v in want_container.items()
        if k not in (*_DETAILED, "command") and not _covers(live_container.get(k), v)
    ]
    live_spec = live.get("spec") or {}
    changes += [
        f"spec.{k} changed"
        for k, v in (desired.get("spec") or {}).items()
        if k != "containers" and not _covers(live_spec.get(k), v)
    ]
    return changes
