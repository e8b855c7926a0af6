"""Endpoint authenticity: the operator signs every registry value with an Ed25519 key, routers verify it.

etcd's roles (``tandem.etcd_auth``) decide who may write an endpoint; the signature decides what a router believes.
A forged endpoint -- written by whoever holds write access that is not the operator's signing key (a stolen etcd
client certificate, the etcd root user, a backup restored by hand) -- has no valid signature and is ignored, so
users' prompts never go to it. Only the operator holds the private key; routers hold the public key, so a
compromised router cannot sign.

The signature covers the registry key and the value (``tandem.registry.signed_payload``): a signed value cannot be
moved to another cluster's or group's key. From schema version 2 on it covers the whole stored object, members the
router's version does not know included (``tandem.registry_versions``), so a router that ignores a newer version's
member still refuses a value in which that member was added or changed by someone else.

Not covered: replaying an *older* signed value of the same key (an earlier incarnation). Routers count such a value
as a group going back in epoch, and the operator re-puts the current value at its next reconcile (``--resync``,
30 s by default).
"""

from __future__ import annotations

import base64
from pathlib import Path

from cryptography import x509
from cryptography.exceptions import InvalidSignature
from cryptography.hazmat.primitives import serialization
from cryptography.hazmat.primitives.asymmetric.ed25519 import Ed25519PrivateKey, Ed25519PublicKey

from tandem.registry import Endpoint, encode, endpoint_key, signed_payload, stamped


class EndpointSigner:
    """The operator's side: adds a signature to each value it writes."""

    def __init__(self, private_key: Ed25519PrivateKey) -> None:
        self._key = private_key
        self.verifier = EndpointVerifier(private_key.public_key())

    @classmethod
    def from_file(cls, path: str | Path) -> EndpointSigner:
        key = serialization.load_pem_private_key(Path(path).read_bytes(), password=None)
        if not isinstance(key, Ed25519PrivateKey):
            raise ValueError(f"{path}: not an Ed25519 private key (make one with 'openssl genpkey -algorithm ed25519')")
        return cls(key)

    def sign(self, key: str, endpoint: Endpoint) -> Endpoint:
        """The endpoint as written (stamped with the current schema version), signed for ``key``."""
        endpoint = stamped(endpoint)
        signature = self._key.sign(signed_payload(key, endpoint))
        return endpoint.model_copy(update={"signature": base64.b64encode(signature).decode()})


def registry_entry(
    namespace: str, cluster: str, endpoint: Endpoint, signer: EndpointSigner | None
) -> tuple[str, bytes]:
    """An endpoint's registry key and value as written to etcd, signed for that key when there is a signer."""
    key = endpoint_key(namespace, cluster, endpoint)
    if signer is not None:
        endpoint = signer.sign(key, endpoint)
    return key, encode(endpoint)


class EndpointVerifier:
    """The router's side: True only for a value the operator signed for this very key."""

    def __init__(self, public_key: Ed25519PublicKey) -> None:
        self._key = public_key

    @classmethod
    def from_file(cls, path: str | Path) -> EndpointVerifier:
        """A PEM public key, or a PEM certificate of one (the chart's signing key comes as a certificate, the only
        form in which Helm's template functions and cert-manager hand out a public key)."""
        data = Path(path).read_bytes()
        if b"BEGIN CERTIFICATE" in data:
            key: object = x509.load_pem_x509_certificate(data).public_key()
        else:
            key = serialization.load_pem_public_key(data)
        if not isinstance(key, Ed25519PublicKey):
            raise ValueError(f"{path}: not an Ed25519 public key or certificate")
        return cls(key)

    def verify(self, key: str, endpoint: Endpoint) -> bool:
        try:
            signature = base64.b64decode(endpoint.signature, validate=True)
            self._key.verify(signature, signed_payload(key, endpoint))
        except (InvalidSignature, ValueError):
            return False
        return True


def write_keypair(private_path: Path, public_path: Path) -> None:
    """A new Ed25519 key pair as PEM files (the private one readable by its owner only)."""
    key = Ed25519PrivateKey.generate()
    private = key.private_bytes(
        serialization.Encoding.PEM, serialization.PrivateFormat.PKCS8, serialization.NoEncryption()
    )
    public = key.public_key().public_bytes(serialization.Encoding.PEM, serialization.PublicFormat.SubjectPublicKeyInfo)
    private_path.touch(mode=0o600)
    private_path.write_bytes(private)
    public_path.write_bytes(public)
