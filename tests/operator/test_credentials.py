"""The operator's credentials loader: a kubeconfig's current context (merged files, relative paths, data fields,
token or tokenFile), the pod's ServiceAccount, the order between them, and refusals that name the problem."""

from __future__ import annotations

import base64
import os
from pathlib import Path
from typing import Any

import pytest
import yaml

from tandem.kube.credentials import ConfigError, Credentials, from_kubeconfig, in_cluster, load
from tandem_operator.act.k8s.login import connection_info

PEM = "-----BEGIN CERTIFICATE-----\nMIIB\n-----END CERTIFICATE-----\n"


def write(path: Path, doc: dict[str, Any]) -> str:
    path.write_text(yaml.safe_dump(doc))
    return str(path)


def kubeconfig(user: dict[str, Any], cluster: dict[str, Any] | None = None, current: str = "dev") -> dict[str, Any]:
    cluster = cluster or {"server": "https://10.0.0.1:6443/", "certificate-authority": "ca.crt"}
    return {
        "current-context": current,
        "contexts": [{"name": "dev", "context": {"cluster": "c", "user": "u", "namespace": "ops"}}],
        "clusters": [{"name": "c", "cluster": cluster}],
        "users": [{"name": "u", "user": user}],
    }


def test_client_certificate_files_are_relative_to_the_kubeconfig(tmp_path: Path) -> None:
    (tmp_path / "sub").mkdir()
    path = write(tmp_path / "sub" / "config", kubeconfig({"client-certificate": "u.crt", "client-key": "/abs/u.key"}))
    assert from_kubeconfig(path) == Credentials(
        server="https://10.0.0.1:6443",
        ca_path=str(tmp_path / "sub" / "ca.crt"),
        certificate_path=str(tmp_path / "sub" / "u.crt"),
        private_key_path="/abs/u.key",
        namespace="ops",
    )


def test_data_fields_and_a_token(tmp_path: Path) -> None:
    data = base64.b64encode(PEM.encode()).decode()
    cluster = {"server": "https://k", "certificate-authority-data": data, "insecure-skip-tls-verify": True}
    creds = from_kubeconfig(write(tmp_path / "c", kubeconfig({"token": "abc"}, cluster)))
    assert (creds.ca_data, creds.ca_path, creds.insecure, creds.bearer_token()) == (data, None, True, "abc")
    info = connection_info(creds)
    assert (info.server, info.scheme, info.token, info.default_namespace) == ("https://k", "Bearer", "abc", "ops")


def test_a_token_file_is_read_for_every_request(tmp_path: Path) -> None:
    (tmp_path / "token").write_text("one\n")
    creds = from_kubeconfig(write(tmp_path / "c", kubeconfig({"tokenFile": "token"})))
    assert creds.bearer_token() == "one"
    (tmp_path / "token").write_text("two")  # the kubelet rotated it
    assert creds.bearer_token() == "two"
    assert connection_info(creds).token == "two"
    (tmp_path / "token").write_text("")
    with pytest.raises(ConfigError, match="is empty"):
        creds.bearer_token()


def test_merged_kubeconfigs_first_value_wins(tmp_path: Path) -> None:
    first = write(tmp_path / "a", {"current-context": "dev", "users": [{"name": "u", "user": {"token": "first"}}]})
    second = write(tmp_path / "b", kubeconfig({"token": "second"}, current="other"))
    creds = from_kubeconfig(os.pathsep.join([first, second]))
    assert (creds.server, creds.bearer_token()) == ("https://10.0.0.1:6443", "first")


@pytest.mark.parametrize(
    ("doc", "message"),
    [
        ({}, "no current-context"),
        (kubeconfig({"token": "t"}, current="gone"), "context 'gone' not found"),
        (kubeconfig({"token": "t"}, {"certificate-authority": "ca"}), "has no cluster with a server"),
        (kubeconfig({"exec": {"command": "aws"}}), "user 'u' uses exec, unsupported"),
        (kubeconfig({"auth-provider": {"name": "oidc"}}), "user 'u' uses auth-provider, unsupported"),
    ],
)
def test_unusable_kubeconfigs_are_refused_by_name(tmp_path: Path, doc: dict[str, Any], message: str) -> None:
    with pytest.raises(ConfigError, match=message):
        from_kubeconfig(write(tmp_path / "c", doc))
    with pytest.raises(ConfigError, match="cannot read kubeconfig"):
        from_kubeconfig(str(tmp_path / "missing"))


def service_account(directory: Path, token: str = "sa-token") -> Path:
    directory.mkdir()
    (directory / "token").write_text(token)
    (directory / "ca.crt").write_text(PEM)
    (directory / "namespace").write_text("ops\n")
    return directory


def test_in_cluster_from_the_service_account_and_the_service_env(tmp_path: Path) -> None:
    sa = service_account(tmp_path / "sa")
    env = {"KUBERNETES_SERVICE_HOST": "10.96.0.1", "KUBERNETES_SERVICE_PORT": "443"}
    assert in_cluster(sa, env) == Credentials(
        server="https://10.96.0.1:443", ca_path=str(sa / "ca.crt"), token_path=str(sa / "token"), namespace="ops"
    )
    assert in_cluster(sa, {**env, "KUBERNETES_SERVICE_HOST": "fd00::1"}).server == "https://[fd00::1]:443"  # type: ignore[union-attr]
    assert in_cluster(sa, {}) is None  # not in a pod
    assert in_cluster(tmp_path / "none", env) is None
    (sa / "ca.crt").write_text("")
    with pytest.raises(ConfigError, match="CA"):
        in_cluster(sa, env)
    with pytest.raises(ConfigError, match="is empty"):
        in_cluster(service_account(tmp_path / "empty", token=""), env)


def test_load_prefers_the_given_kubeconfig_then_the_pod_then_the_home_config(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setenv("HOME", str(tmp_path))
    monkeypatch.delenv("KUBERNETES_SERVICE_HOST", raising=False)
    with pytest.raises(ConfigError, match="no --kubeconfig, not in a pod"):
        load(None)
    (tmp_path / ".kube").mkdir()
    write(tmp_path / ".kube" / "config", kubeconfig({"token": "home"}))
    assert load(None).bearer_token() == "home"
    given = write(tmp_path / "given", kubeconfig({"token": "given"}))
    assert load(given).bearer_token() == "given"
