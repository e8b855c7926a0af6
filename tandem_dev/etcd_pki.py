"""The local stack's own etcd PKI (``tandem up``): a CA, a certificate per member (server and peer), one client
certificate per etcd user (``tandem.etcd_auth``) and the operator's registry signing key pair, all under the
stack's state directory. Made with ``openssl`` (``tandem_dev.devcluster.pki``) and ``cryptography``; nothing leaves
the directory, and a new stack makes new ones."""

from __future__ import annotations

import ssl
from dataclasses import dataclass
from pathlib import Path

from tandem.etcd_auth import OPERATOR_USER, ROOT_USER, ROUTER_USER
from tandem.registry import EtcdTLS
from tandem.registry_signing import write_keypair
from tandem_dev.devcluster import pki


@dataclass(frozen=True)
class EtcdPki:
    directory: Path
    ca: pki.CertPair

    def member(self, name: str) -> pki.CertPair:
        return pki.CertPair(self.directory / f"{name}.crt", self.directory / f"{name}.key")

    def client_pair(self, user: str) -> pki.CertPair:
        return pki.CertPair(self.directory / f"user-{user}.crt", self.directory / f"user-{user}.key")

    def client_tls(self, user: str) -> EtcdTLS:
        pair = self.client_pair(user)
        return EtcdTLS(ca_file=str(self.ca.cert), cert_file=str(pair.cert), key_file=str(pair.key))

    def router_flags(self) -> list[str]:
        """``tandem router`` flags: the router's etcd user, and the key that checks the operator's signatures."""
        pair = self.client_pair(ROUTER_USER)
        flags = {"--etcd-ca-file": self.ca.cert, "--etcd-cert-file": pair.cert, "--etcd-key-file": pair.key}
        flags["--registry-verify-key"] = self.verify_key
        return [arg for flag, path in flags.items() for arg in (flag, str(path))]

    @property
    def signing_key(self) -> Path:
        return self.directory / "registry-signing.key"

    @property
    def verify_key(self) -> Path:
        return self.directory / "registry-signing.pub"

    def ssl_context(self, user: str = ROOT_USER) -> ssl.SSLContext:
        """An HTTPS client context as ``user`` (etcd's /health asks for a client certificate too)."""
        context = ssl.create_default_context(cafile=self.ca.cert)
        context.load_cert_chain(self.client_pair(user).cert, self.client_pair(user).key)
        return context


def create_etcd_pki(directory: Path, members: list[str], host: str) -> EtcdPki:
    """Certificates for etcd ``members`` serving on ``host`` (an IP), and for every etcd user."""
    directory.mkdir(parents=True, exist_ok=True)
    ca = pki.create_ca(directory, "tandem-etcd-ca")
    for member in members:
        pki.issue_serving_cert(ca, directory, member, [host], ["localhost"], peer=True)
    for user in (ROOT_USER, OPERATOR_USER, ROUTER_USER):
        pki.issue_client_cert(ca, directory, user)
    made = EtcdPki(directory, ca)
    write_keypair(made.signing_key, made.verify_key)
    return made
