"""The etcd client's TLS settings, declared once for every component that talks to the registry etcd: a settings
group (``tandem.settings_flags.SettingsGroup``) that the router's ``RouterSettings`` holds as its ``etcd`` (with the
router's endpoints, ``RouterEtcdSettings``) and the operator's parsed arguments as theirs (``OperatorEtcdSettings``),
so both take ``--etcd-ca-file``, ``--etcd-cert-file``, ``--etcd-key-file`` and ``--etcd-server-name`` with one
meaning: setting ``ca_file`` is flag ``--etcd-ca-file``, flat name ``etcd_ca_file``."""

from __future__ import annotations

from typing import ClassVar, Self

from pydantic import Field, FilePath, model_validator

from tandem.registry import EtcdTLS
from tandem.settings_flags import SettingsGroup


class EtcdClientSettings(SettingsGroup):
    flag_prefix: ClassVar[str] = "etcd_"

    ca_file: FilePath | None = Field(default=None, description="CA of etcd's server certificates (turns TLS on).")
    cert_file: FilePath | None = Field(
        default=None, description="Client certificate of this component's etcd user (etcd takes its CN as the user)."
    )
    key_file: FilePath | None = Field(default=None, description="Private key of etcd_cert_file.")
    server_name: str | None = Field(
        default=None, description="Name etcd's certificate is checked against (default: the first endpoint's host)."
    )

    @property
    def tls(self) -> EtcdTLS:
        files = {"ca_file": self.ca_file, "cert_file": self.cert_file, "key_file": self.key_file}
        return EtcdTLS(**{k: str(v) for k, v in files.items() if v is not None}, server_name=self.server_name)

    @model_validator(mode="after")
    def _tls_files(self) -> Self:
        self.tls  # noqa: B018 -- raises on a certificate without its key, or without a CA
        return self
