"""The etcd client's TLS settings, declared once for every component that talks to the registry etcd: the router's
``RouterSettings`` inherits them and the operator makes its flags from them (``tandem.settings_flags``), so both
take ``--etcd-ca-file``, ``--etcd-cert-file``, ``--etcd-key-file`` and ``--etcd-server-name`` with one meaning."""

from __future__ import annotations

from typing import Self

from pydantic import BaseModel, Field, FilePath, model_validator

from tandem.registry import EtcdTLS


class EtcdClientSettings(BaseModel):
    etcd_ca_file: FilePath | None = Field(default=None, description="CA of etcd's server certificates (turns TLS on).")
    etcd_cert_file: FilePath | None = Field(
        default=None, description="Client certificate of this component's etcd user (etcd takes its CN as the user)."
    )
    etcd_key_file: FilePath | None = Field(default=None, description="Private key of etcd_cert_file.")
    etcd_server_name: str | None = Field(
        default=None, description="Name etcd's certificate is checked against (default: the first endpoint's host)."
    )

    @property
    def etcd_tls(self) -> EtcdTLS:
        files = {"ca_file": self.etcd_ca_file, "cert_file": self.etcd_cert_file, "key_file": self.etcd_key_file}
        return EtcdTLS(**{k: str(v) for k, v in files.items() if v is not None}, server_name=self.etcd_server_name)

    @model_validator(mode="after")
    def _tls_files(self) -> Self:
        self.etcd_tls  # noqa: B018 -- raises on a certificate without its key, or without a CA
        return self
