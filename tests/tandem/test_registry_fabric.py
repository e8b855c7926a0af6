"""The registry's fabric fields: optional, absent from entries that do not set them (entries of older operators are
read and verified as before), carried through a signed round trip when set."""

from __future__ import annotations

import base64
import json

import pydantic
import pytest
from cryptography.hazmat.primitives.asymmetric.ed25519 import Ed25519PrivateKey

from tandem import registry
from tandem.registry import Endpoint, FabricMode, Role
from tandem.registry_signing import EndpointSigner, registry_entry
from tandem.registry_versions import SCHEMA_VERSION

# An entry as the operator wrote it before the fabric fields existed (signed below with that era's payload).
OLD_ENTRY = {
    "role": "prefill",
    "group": "prefill-0",
    "url": "http://10.0.0.5:30000",
    "bootstrap_port": 8998,
    "mooncake_sessions": ["10.0.0.5:15000"],
    "ib_devices": [],
    "attn_dp_size": 1,
    "model": "kimi-k2.6",
    "revision": "abc",
    "epoch": 2,
    "signature": "",
}


def test_an_older_entry_parses_with_an_unknown_domain_and_encodes_without_fabric_members() -> None:
    old = json.dumps(OLD_ENTRY, separators=(",", ":")).encode()
    endpoint = registry.decode(old)
    assert (endpoint.fabric_domain, endpoint.fabric_mode) == (None, None)
    # written again by this version: the same members, stamped with the current schema version, no fabric member
    assert json.loads(registry.encode(endpoint)) == {"schema_version": SCHEMA_VERSION, **OLD_ENTRY}


def test_an_older_operators_signature_still_verifies() -> None:
    key = Ed25519PrivateKey.generate()
    path = "/tandem/v1/clusters/ns/c/endpoints/prefill/prefill-0"
    unsigned = {k: v for k, v in OLD_ENTRY.items() if k != "signature"}
    signature = key.sign(path.encode() + b"\n" + json.dumps(unsigned, separators=(",", ":")).encode())
    signed = {**OLD_ENTRY, "signature": base64.b64encode(signature).decode()}
    endpoint = registry.decode(json.dumps(signed).encode())
    assert EndpointSigner(key).verifier.verify(path, endpoint)


def test_a_fabric_entry_round_trips_signed() -> None:
    endpoint = Endpoint(
        role=Role.DECODE,
        group="decode-1",
        url="http://10.0.1.7:30001",
        model="m",
        fabric_domain="rack-7",
        fabric_mode=FabricMode.REQUIRED,
    )
    signer = EndpointSigner(Ed25519PrivateKey.generate())
    key, value = registry_entry("ns", "c", endpoint, signer)
    assert json.loads(value)["fabric_domain"] == "rack-7"
    assert json.loads(value)["fabric_mode"] == "required"
    back = registry.decode(value)
    assert back.model_copy(update={"signature": ""}) == endpoint
    assert signer.verifier.verify(key, back)
    moved = back.model_copy(update={"fabric_domain": "rack-8"})  # another domain is another value: not signed
    assert not signer.verifier.verify(key, moved)


@pytest.mark.parametrize(("field", "value"), [("fabric_domain", ""), ("fabric_domain", "a b"), ("fabric_mode", "x")])
def test_fabric_fields_are_checked(field: str, value: str) -> None:
    base = {"role": "decode", "group": "decode-0", "url": "http://127.0.0.1:1", "model": "m"}
    with pytest.raises(pydantic.ValidationError, match=field):
        Endpoint.model_validate({**base, field: value})
