"""Registry schema versions (``tandem.registry_versions``): a reader uses values one version back and one ahead,
ignores the members it does not know, refuses the rest per key; the signature covers the whole stored object,
unknown members included."""

from __future__ import annotations

import base64
import json
import logging
from typing import Any

import pytest
from cryptography.hazmat.primitives.asymmetric.ed25519 import Ed25519PrivateKey
from prometheus_client import generate_latest

from tandem import registry
from tandem.registry import Endpoint, Role
from tandem.registry_etcd import EndpointWatcher
from tandem.registry_signing import EndpointSigner, registry_entry
from tandem.registry_versions import (
    SCHEMA_VERSION,
    EntryRefusedError,
    Refusal,
    Relation,
    canonical,
    relation,
)
from tandem_router.metrics import RouterMetrics
from tandem_router.pool import WorkerPool

KEY = "/tandem/v1/clusters/ns/c/endpoints/decode/decode-0"
# The members every version-2 writer writes for this decode (no fabric: left out while unset).
CURRENT = {
    "schema_version": 2,
    "role": "decode",
    "group": "decode-0",
    "url": "http://10.0.0.7:30000",
    "bootstrap_port": None,
    "mooncake_sessions": ["10.0.0.7:15000"],
    "ib_devices": ["mlx5_0"],
    "attn_dp_size": 1,
    "model": "kimi-k2.6",
    "revision": "r1",
    "epoch": 4,
    "signature": "",
}
# What a version-3 writer would write: every version-2 member, plus an optional one version 2 does not know.
KV_LAYOUT: dict[str, Any] = {"page": 64, "dtype": "fp8", "hint": 0.5}
AHEAD = {**CURRENT, "schema_version": 3, "kv_layout": KV_LAYOUT}


def value(obj: dict[str, Any]) -> bytes:
    return json.dumps(obj).encode()


def signed(private: Ed25519PrivateKey, obj: dict[str, Any], key: str = KEY) -> dict[str, Any]:
    """``obj`` signed as a writer of any version >= 2 signs it: the key and the canonical object but its signature."""
    payload = key.encode() + b"\n" + canonical({k: v for k, v in obj.items() if k != "signature"})
    return {**obj, "signature": base64.b64encode(private.sign(payload)).decode()}


def test_the_signed_form_is_sorted_compact_ascii_json() -> None:
    assert canonical({"b": 1, "a": [1, "é", None], "c": {"z": 0.5, "y": True}}) == (
        b'{"a":[1,"\\u00e9",null],"b":1,"c":{"y":true,"z":0.5}}'
    )


@pytest.mark.parametrize(
    ("version", "expected"),
    [
        (SCHEMA_VERSION - 1, Relation.OLDER),
        (SCHEMA_VERSION, Relation.CURRENT),
        (SCHEMA_VERSION + 1, Relation.NEWER),
        (SCHEMA_VERSION + 2, Relation.UNSUPPORTED),
        (SCHEMA_VERSION - 2, Relation.UNSUPPORTED),
    ],
)
def test_relation_is_one_back_current_or_one_ahead(version: int, expected: Relation) -> None:
    assert relation(version) is expected


def test_an_entry_without_a_version_is_version_1_with_its_missing_members_defaulted() -> None:
    old = {"role": "decode", "group": "decode-0", "url": "http://10.0.0.7:30000", "model": "m"}
    endpoint = registry.decode(value(old))
    assert endpoint.schema_version == 1
    assert relation(endpoint.schema_version) is Relation.OLDER
    assert (endpoint.epoch, endpoint.mooncake_sessions, endpoint.revision, endpoint.attn_dp_size) == (0, (), "", 1)
    assert json.loads(registry.encode(endpoint))["schema_version"] == SCHEMA_VERSION  # writers stamp theirs


def test_a_current_entry_round_trips_and_writers_stamp_the_current_version() -> None:
    endpoint = Endpoint(role=Role.DECODE, group="decode-0", url="http://10.0.0.7:30000", model="m")
    stored = registry.encode(endpoint)
    assert json.loads(stored)["schema_version"] == SCHEMA_VERSION
    back = registry.decode(stored)
    assert back == endpoint
    assert relation(back.schema_version) is Relation.CURRENT
    assert back.ignored_members == ()


def test_an_entry_one_ahead_is_used_and_its_unknown_member_ignored() -> None:
    endpoint = registry.decode(value(AHEAD))
    assert endpoint.schema_version == SCHEMA_VERSION + 1
    assert relation(endpoint.schema_version) is Relation.NEWER
    assert endpoint.ignored_members == ("kv_layout",)
    assert (endpoint.url, endpoint.epoch, endpoint.mooncake_sessions) == (
        "http://10.0.0.7:30000",
        4,
        ("10.0.0.7:15000",),
    )
    assert not hasattr(endpoint, "kv_layout")
    rewritten = json.loads(registry.encode(endpoint))  # what this version writes of it: its own members, its version
    assert "kv_layout" not in rewritten
    assert rewritten["schema_version"] == SCHEMA_VERSION


@pytest.mark.parametrize("ahead", [2, 3, 10])
def test_an_entry_two_or_more_ahead_is_refused(ahead: int) -> None:
    with pytest.raises(EntryRefusedError) as refused:
        registry.decode(value({**AHEAD, "schema_version": SCHEMA_VERSION + ahead}))
    assert refused.value.reason is Refusal.TOO_NEW
    assert refused.value.version == SCHEMA_VERSION + ahead


@pytest.mark.parametrize(
    ("raw", "why"),
    [
        (value({**AHEAD, "epoch": "four"}), "epoch"),  # a known member with an invalid value, even one ahead
        (value({**AHEAD, "url": 7}), "url"),
        (value({**CURRENT, "schema_version": "2"}), "positive integer"),
        (value({**CURRENT, "schema_version": True}), "positive integer"),
        (value({**CURRENT, "schema_version": 0}), "positive integer"),
        (value({**CURRENT, "schema_version": 2.5}), "positive integer"),
        (b'{"schema_version":2,"role":"decode","role":"prefill"}', "twice"),
        (b'{"schema_version":3,"x":NaN}', "NaN"),
        (b"[1, 2]", "not a JSON object"),
        (b"{not json", "not JSON"),
        (value({"role": "decode", "group": "d", "url": "http://h:1", "model": "m", "surprise": 1}), "never had"),
    ],
)
def test_an_invalid_entry_is_refused_naming_why(raw: bytes, why: str) -> None:
    with pytest.raises(EntryRefusedError, match=why) as refused:
        registry.decode(raw)
    assert refused.value.reason is Refusal.INVALID


def test_the_signature_covers_members_the_reader_does_not_know() -> None:
    private = Ed25519PrivateKey.generate()
    verifier = EndpointSigner(private).verifier
    ahead = signed(private, AHEAD)
    assert verifier.verify(KEY, registry.decode(value(ahead)))
    tampered = {**ahead, "kv_layout": {**KV_LAYOUT, "dtype": "fp16"}}  # an unknown member changed
    assert not verifier.verify(KEY, registry.decode(value(tampered)))
    added = {**ahead, "steer_to": "http://10.6.6.6:1"}  # an unknown member added
    assert not verifier.verify(KEY, registry.decode(value(added)))
    removed = {k: v for k, v in ahead.items() if k != "kv_layout"}
    assert not verifier.verify(KEY, registry.decode(value(removed)))
    moved = {**ahead, "url": "http://10.6.6.6:30000"}  # a known member changed
    assert not verifier.verify(KEY, registry.decode(value(moved)))
    assert not verifier.verify(KEY.replace("decode-0", "decode-1"), registry.decode(value(ahead)))


def test_the_version_is_signed_too_so_no_value_changes_form() -> None:
    private = Ed25519PrivateKey.generate()
    verifier = EndpointSigner(private).verifier
    current = signed(private, CURRENT)
    assert verifier.verify(KEY, registry.decode(value(current)))
    for version in (1, 3):  # stamped otherwise: version 1 (no member) takes the legacy payload, 3 the canonical one
        other = {**current, "schema_version": version} if version != 1 else current.copy()
        if version == 1:
            del other["schema_version"]
        assert not verifier.verify(KEY, registry.decode(value(other)))


def test_an_endpoint_read_then_changed_in_memory_no_longer_verifies() -> None:
    private = Ed25519PrivateKey.generate()
    verifier = EndpointSigner(private).verifier
    endpoint = registry.decode(value(signed(private, AHEAD)))
    assert verifier.verify(KEY, endpoint)
    assert not verifier.verify(KEY, endpoint.model_copy(update={"url": "http://10.6.6.6:30000"}))
    assert not verifier.verify(KEY, endpoint.model_copy(update={"schema_version": SCHEMA_VERSION}))


def test_the_writers_signature_verifies_after_the_etcd_round_trip() -> None:
    signer = EndpointSigner(Ed25519PrivateKey.generate())
    old = registry.decode(value({k: v for k, v in CURRENT.items() if k != "schema_version"}))
    assert old.schema_version == 1
    key, stored = registry_entry("ns", "c", old, signer)  # a version-1 entry the operator writes again
    back = registry.decode(stored)
    assert back.schema_version == SCHEMA_VERSION
    assert signer.verifier.verify(key, back)


# -- the router's watcher: refused per key, logged, counted ----------------------------------------------------------


async def test_the_watcher_refuses_one_key_logs_why_and_counts_by_relation(caplog: pytest.LogCaptureFixture) -> None:
    seen: dict[str, Endpoint] = {}
    watcher = EndpointWatcher(
        ["127.0.0.1:1"], "ns", "c", on_snapshot=seen.update, on_put=seen.__setitem__, on_delete=seen.__delitem__
    )
    prefix = registry.cluster_prefix("ns", "c")
    entries = {
        f"{prefix}decode/decode-0": value(CURRENT),
        f"{prefix}decode/decode-1": value({**AHEAD, "group": "decode-1"}),
        f"{prefix}decode/decode-2": value(
            {k: v for k, v in CURRENT.items() if k != "schema_version"} | {"group": "decode-2"}
        ),
        f"{prefix}decode/decode-3": value({**AHEAD, "group": "decode-3", "schema_version": SCHEMA_VERSION + 2}),
    }
    current: dict[str, Endpoint] = {}
    with caplog.at_level(logging.ERROR, logger="tandem.registry"):
        for key, raw in entries.items():
            endpoint = watcher._parse(key.encode(), raw)
            if endpoint is None:
                watcher.skipped.add(key)
            else:
                current[key] = endpoint
    await watcher._changed(current)
    assert sorted(seen) == sorted(entries)[:3]  # the refused key only is left out
    (record,) = [r for r in caplog.records if r.getMessage().startswith("registry entry refused")]
    assert (vars(record)["key"], vars(record)["reason"], vars(record)["schema_version"]) == (
        f"{prefix}decode/decode-3",
        "too_new",
        SCHEMA_VERSION + 2,
    )
    assert watcher.census.counts() == {
        Relation.OLDER: 1, Relation.CURRENT: 1, Relation.NEWER: 1, Relation.UNSUPPORTED: 1
    }  # fmt: skip
    assert watcher.census.refused == {Refusal.TOO_NEW: 1}

    pool = WorkerPool()
    pool.registry_census = watcher.census
    text = generate_latest(RouterMetrics(pool).registry).decode()
    assert 'tandem_router_registry_entries_by_schema{relation="newer"} 1.0' in text
    assert 'tandem_router_registry_entries_by_schema{relation="unsupported"} 1.0' in text
    assert 'tandem_router_registry_refused_entries_total{reason="too_new"} 1.0' in text
    assert 'tandem_router_registry_refused_entries_total{reason="invalid"} 0.0' in text
