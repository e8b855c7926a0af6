"""Where the API server is and how to authenticate: a kubeconfig's current context, or the pod's ServiceAccount.

The shared client (``tandem.kube.rest``) and the operator's kopf login (``tandem_operator.act.k8s.login``) use the
same ``Credentials``, so neither the operator nor the router needs a Kubernetes client library (kubernetes_asyncio
alone cost ~40 MiB of RSS in imports). What is understood, as client-go does: a kubeconfig (``KUBECONFIG`` may list
several files, merged, the first value wins) with a server, a CA (file or ``-data``) or
``insecure-skip-tls-verify``, and a client certificate and key (files or ``-data``), a ``token`` or a ``tokenFile``;
relative paths are relative to the file that names them. In a pod: ``KUBERNETES_SERVICE_HOST``/``_PORT`` with the
mounted token and CA. A token file is read for every request (the kubelet rotates a ServiceAccount token, replacing
the file atomically). Exec plugins, auth providers and basic auth are refused with a ``ConfigError`` naming them.
"""

from __future__ import annotations

import base64
import contextlib
import os
import ssl
import tempfile
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import yaml

SERVICE_ACCOUNT = Path("/var/run/secrets/kubernetes.io/serviceaccount")
DEFAULT_KUBECONFIG = "~/.kube/config"
UNSUPPORTED_AUTH = ("exec", "auth-provider", "username", "password")


class ConfigError(Exception):
    """No usable credentials (no kubeconfig, not in a pod, or a kubeconfig this loader cannot use)."""


@dataclass(frozen=True)
class Credentials:
    server: str  # https://host:port
    ca_path: str | None = None
    ca_data: str | None = None  # PEM or base64 of PEM (a kubeconfig's certificate-authority-data)
    insecure: bool = False
    token: str | None = None
    token_path: str | None = None  # read for every request
    certificate_path: str | None = None
    certificate_data: str | None = None
    private_key_path: str | None = None
    private_key_data: str | None = None
    namespace: str | None = None

    def bearer_token(self) -> str | None:
        if self.token_path is None:
            return self.token
        try:
            token = Path(self.token_path).read_text().strip()
        except OSError as err:
            raise ConfigError(f"cannot read the token file {self.token_path}: {err}") from err
        if not token:
            raise ConfigError(f"token file {self.token_path} is empty")
        return token

    def ssl_context(self) -> ssl.SSLContext:
        """The CA to verify the server with and the client certificate, as kopf's ``ConnectionInfo.as_ssl_context``
        builds them (which the operator used before): ``-data`` fields go through a temporary file for a moment,
        since :mod:`ssl` loads a certificate chain from files only."""
        with contextlib.ExitStack() as stack:

            def path(file_path: str | None, data: str | None) -> str | None:
                if file_path or not data:
                    return file_path
                file = stack.enter_context(tempfile.NamedTemporaryFile(buffering=0))
                file.write(_pem(data).encode("ascii"))
                return file.name

            cadata = _pem(self.ca_data) if self.ca_data is not None else None
            context = ssl.create_default_context(purpose=ssl.Purpose.SERVER_AUTH, cafile=self.ca_path, cadata=cadata)
            certificate = path(self.certificate_path, self.certificate_data)
            key = path(self.private_key_path, self.private_key_data)
            if certificate and key:
                context.load_cert_chain(certfile=certificate, keyfile=key)
        if self.insecure:
            context.check_hostname = False
            context.verify_mode = ssl.CERT_NONE
        return context


def _pem(data: str) -> str:
    """A kubeconfig's ``-data`` field: PEM, or base64 of PEM."""
    return data if data.startswith("-----BEGIN ") else base64.b64decode(data).decode("ascii")


def in_cluster(directory: Path = SERVICE_ACCOUNT, env: dict[str, str] | None = None) -> Credentials | None:
    """The pod's ServiceAccount, or None outside a pod (no ``KUBERNETES_SERVICE_HOST`` or no token)."""
    env = dict(os.environ) if env is None else env
    host, port = env.get("KUBERNETES_SERVICE_HOST"), env.get("KUBERNETES_SERVICE_PORT")
    token = directory / "token"
    if not host or not port or not token.is_file():
        return None
    ca = directory / "ca.crt"
    if not ca.is_file() or not ca.read_text().strip():
        raise ConfigError(f"in a pod, but the ServiceAccount CA {ca} is missing or empty")
    namespace = directory / "namespace"
    credentials = Credentials(
        server=f"https://[{host}]:{port}" if ":" in host else f"https://{host}:{port}",
        ca_path=str(ca),
        token_path=str(token),
        namespace=namespace.read_text().strip() if namespace.is_file() else None,
    )
    credentials.bearer_token()  # an empty token file fails here, at start
    return credentials


def _merged(paths: list[Path]) -> tuple[str | None, dict[str, dict[str, Any]]]:
    """The first current-context, and every named context, cluster and user (``kind/name`` -> entry)."""
    current, entries = None, {}
    for path in paths:
        try:
            doc = yaml.safe_load(path.read_text()) or {}
        except (OSError, yaml.YAMLError) as err:
            raise ConfigError(f"cannot read kubeconfig {path}: {err}") from err
        current = current or doc.get("current-context")
        for kind in ("contexts", "clusters", "users"):
            for item in doc.get(kind) or ():
                key = f"{kind}/{item.get('name')}"
                if key not in entries:
                    entries[key] = {**(item.get(kind[:-1]) or {}), "_dir": path.parent}
    return current, entries


def _path(entry: dict[str, Any], key: str) -> str | None:
    value = entry.get(key)
    return str(entry["_dir"] / Path(value).expanduser()) if value else None


def from_kubeconfig(kubeconfig: str) -> Credentials:
    """The current context of ``kubeconfig`` (one path, or several joined by ``os.pathsep``)."""
    paths = [Path(p).expanduser() for p in kubeconfig.split(os.pathsep) if p]
    current, entries = _merged(paths)
    if not current:
        raise ConfigError(f"kubeconfig {kubeconfig}: no current-context")
    context = entries.get(f"contexts/{current}")
    if context is None:
        raise ConfigError(f"kubeconfig {kubeconfig}: context {current!r} not found")
    cluster = entries.get(f"clusters/{context.get('cluster')}")
    user = entries.get(f"users/{context.get('user')}", {})
    if cluster is None or not cluster.get("server"):
        raise ConfigError(f"kubeconfig {kubeconfig}: context {current!r} has no cluster with a server")
    unsupported = [key for key in UNSUPPORTED_AUTH if user.get(key)]
    if unsupported:
        raise ConfigError(f"kubeconfig {kubeconfig}: user {context.get('user')!r} uses {unsupported[0]}, unsupported")
    return Credentials(
        server=str(cluster["server"]).rstrip("/"),
        ca_path=_path(cluster, "certificate-authority"),
        ca_data=cluster.get("certificate-authority-data"),
        insecure=bool(cluster.get("insecure-skip-tls-verify")),
        token=user.get("token"),
        token_path=None if user.get("token") else _path(user, "tokenFile"),
        certificate_path=_path(user, "client-certificate"),
        certificate_data=user.get("client-certificate-data"),
        private_key_path=_path(user, "client-key"),
        private_key_data=user.get("client-key-data"),
        namespace=context.get("namespace"),
    )


def load(kubeconfig: str | None) -> Credentials:
    """``kubeconfig`` if given, else the pod's ServiceAccount, else ``~/.kube/config``."""
    if kubeconfig:
        return from_kubeconfig(kubeconfig)
    found = in_cluster()
    if found is not None:
        return found
    if not Path(DEFAULT_KUBECONFIG).expanduser().is_file():
        raise ConfigError("no --kubeconfig, not in a pod, and no ~/.kube/config")
    return from_kubeconfig(DEFAULT_KUBECONFIG)
