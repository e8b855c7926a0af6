"""Certificates and keys for the dev cluster, made with the ``openssl`` command line (Debian package ``openssl``).

One self-signed CA signs the API server's serving certificate and every client certificate. A client
certificate's CN is the Kubernetes user name and each O is a group, so ``issue_client_cert`` is how the cluster
mints identities: ``system:masters`` for the admin, anything else for limited users that RBAC then restricts.
"""

from __future__ import annotations

import re
import subprocess
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path

_EC_KEY = ["-newkey", "ec", "-pkeyopt", "ec_paramgen_curve:prime256v1", "-nodes"]
# Characters that would break openssl's "/O=.../CN=..." subject syntax.
_SUBJECT_UNSAFE = re.compile(r"[/\\=+,\n]")


@dataclass(frozen=True)
class CertPair:
    """A PEM certificate and its PEM private key on disk."""

    cert: Path
    key: Path


def _openssl(args: Sequence[str]) -> None:
    result = subprocess.run(["openssl", *args], capture_output=True, text=True, check=False)
    if result.returncode != 0:
        raise RuntimeError(f"openssl {args[0]} failed ({result.returncode}): {result.stderr.strip()}")


def subject(common_name: str, organizations: Sequence[str] = ()) -> str:
    """The openssl ``-subj`` string for a user (CN) in groups (O). Rejects names openssl would misparse."""
    for part in (common_name, *organizations):
        if not part or _SUBJECT_UNSAFE.search(part):
            raise ValueError(f"invalid certificate subject part {part!r}: must be non-empty without / \\ = + ,")
    return "".join(f"/O={org}" for org in organizations) + f"/CN={common_name}"


def create_ca(directory: Path, name: str = "tandem-dev-ca") -> CertPair:
    pair = CertPair(directory / "ca.crt", directory / "ca.key")
    args = ["req", "-x509", *_EC_KEY, "-keyout", str(pair.key), "-out", str(pair.cert), "-days", "3650"]
    args += ["-subj", subject(name), "-addext", "basicConstraints=critical,CA:TRUE"]
    args += ["-addext", "keyUsage=critical,keyCertSign,cRLSign,digitalSignature"]
    _openssl(args)
    return pair


def _issue(ca: CertPair, pair: CertPair, subj: str, extensions: Sequence[str]) -> CertPair:
    args = ["req", "-x509", *_EC_KEY, "-keyout", str(pair.key), "-out", str(pair.cert), "-days", "365"]
    args += ["-subj", subj, "-CA", str(ca.cert), "-CAkey", str(ca.key)]
    args += ["-addext", "basicConstraints=critical,CA:FALSE"]
    for ext in extensions:
        args += ["-addext", ext]
    _openssl(args)
    return pair


def issue_serving_cert(
    ca: CertPair, directory: Path, name: str, ips: Sequence[str], dns: Sequence[str], *, peer: bool = False
) -> CertPair:
    """A server certificate for ``ips`` and ``dns``; ``peer``: also a client one (etcd members dial each other)."""
    san = ",".join([f"IP:{ip}" for ip in ips] + [f"DNS:{d}" for d in dns])
    pair = CertPair(directory / f"{name}.crt", directory / f"{name}.key")
    usage = "extendedKeyUsage=serverAuth,clientAuth" if peer else "extendedKeyUsage=serverAuth"
    return _issue(ca, pair, subject(name), [f"subjectAltName={san}", usage])


def issue_client_cert(ca: CertPair, directory: Path, user: str, groups: Sequence[str] = ()) -> CertPair:
    """A client certificate for Kubernetes user ``user`` in ``groups``."""
    safe = re.sub(r"[^A-Za-z0-9_.-]", "_", user)
    pair = CertPair(directory / f"user-{safe}.crt", directory / f"user-{safe}.key")
    return _issue(ca, pair, subject(user, groups), ["extendedKeyUsage=clientAuth"])


def create_service_account_keys(directory: Path) -> tuple[Path, Path]:
    """An ECDSA key pair: the API server signs service-account tokens with the private key, verifies with both."""
    private, public = directory / "sa.key", directory / "sa.pub"
    _openssl(["genpkey", "-algorithm", "EC", "-pkeyopt", "ec_paramgen_curve:P-256", "-out", str(private)])
    _openssl(["pkey", "-in", str(private), "-pubout", "-out", str(public)])
    return private, public
