"""Kubeconfig documents (pure data): one cluster, one user, one context, credentials by file path or token."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import yaml

CLUSTER_NAME = "tandem-dev"


def kubeconfig(
    server: str,
    ca_cert: Path,
    user: str,
    *,
    client_cert: Path | None = None,
    client_key: Path | None = None,
    token: str | None = None,
    namespace: str = "default",
) -> dict[str, Any]:
    """A kubeconfig for ``user`` that authenticates with a client certificate or a bearer token (exactly one)."""
    if (client_cert is None) == (token is None) or (client_cert is None) != (client_key is None):
        raise ValueError("kubeconfig needs either client_cert and client_key, or token")
    credentials: dict[str, str] = (
        {"token": token}
        if token is not None
        else {"client-certificate": str(client_cert), "client-key": str(client_key)}
    )
    return {
        "apiVersion": "v1",
        "kind": "Config",
        "clusters": [{"name": CLUSTER_NAME, "cluster": {"server": server, "certificate-authority": str(ca_cert)}}],
        "users": [{"name": user, "user": credentials}],
        "contexts": [{"name": user, "context": {"cluster": CLUSTER_NAME, "user": user, "namespace": namespace}}],
        "current-context": user,
    }


def write_kubeconfig(path: Path, doc: dict[str, Any]) -> Path:
    path.write_text(yaml.safe_dump(doc, sort_keys=False))
    path.chmod(0o600)
    return path
