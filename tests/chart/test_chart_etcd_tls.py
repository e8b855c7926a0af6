"""The chart's etcd security: rendered offline, then the PKI the chart generates run on a real etcd.

Without cert-manager the chart generates a CA, the members' server/peer certificate, one client certificate per
etcd user and the registry signing key (Secrets); with cert-manager it asks for the same as Certificates. The
set-up Job's command (``tandem etcd-auth``) with the generated root certificate gives the operator and router
their roles on a real etcd serving the chart's certificate: the router's certificate cannot write an endpoint,
the operator's can, and what the operator signs with the chart's key the routers' certificate verifies.
"""

from __future__ import annotations

import asyncio
import base64
import shutil
from pathlib import Path
from typing import Any

import pytest

from tandem import etcd_auth, registry
from tandem.etcd_errors import EtcdError
from tandem.registry import Endpoint, EtcdTLS, Role
from tandem.registry_etcd import client
from tandem.registry_signing import EndpointSigner, EndpointVerifier
from tandem_dev.procs import ManagedProcess, free_port
from tests.chart.render import render


def _render(*sets: str, api_versions: tuple[str, ...] = ()) -> list[dict[str, Any]]:
    return render(*(a for s in sets for a in ("--set", s)), *(a for v in api_versions for a in ("--api-versions", v)))


def _workload(docs: list[dict[str, Any]], suffix: str) -> dict[str, Any]:
    [found] = [d for d in docs if d["kind"] in {"Deployment", "StatefulSet"} and d["metadata"]["name"].endswith(suffix)]
    spec: dict[str, Any] = found["spec"]["template"]["spec"]
    return spec


def _args(docs: list[dict[str, Any]], suffix: str) -> list[str]:
    container = _workload(docs, suffix)["containers"][0]
    return list(container.get("args") or container["command"])


def test_default_etcd_serves_tls_and_asks_for_client_certificates() -> None:
    docs = _render()
    etcd = _args(docs, "-etcd")
    assert "--client-cert-auth" in etcd
    assert "--peer-client-cert-auth" in etcd
    assert all("http://" not in a for a in etcd if a.startswith(("--listen-client", "--listen-peer", "--initial-cl")))
    for component, key_flag in (("-operator", "--registry-signing-key"), ("-router", "--registry-verify-key")):
        args = _args(docs, component)
        assert "--etcd-cert-file=/etc/tandem/etcd/tls.crt" in args
        assert any(a.startswith(key_flag) for a in args)
    router_volumes = {v["name"]: v["secret"] for v in _workload(docs, "-router")["volumes"]}
    assert router_volumes["etcd-tls"]["secretName"] == "t-tandem-etcd-router-tls"
    assert router_volumes["registry-signing"]["items"] == [{"key": "tls.crt", "path": "tls.crt"}]  # no private key
    [job] = [d for d in docs if d["kind"] == "Job"]
    assert "--cluster=serving/kimi-k26" in job["spec"]["template"]["spec"]["containers"][0]["args"]
    secrets = {d["metadata"]["name"] for d in docs if d["kind"] == "Secret"}
    assert {"t-tandem-etcd-server-tls", "t-tandem-etcd-root-tls", "t-tandem-registry-signing"} <= secrets


def test_cert_manager_issues_the_same_secrets() -> None:
    docs = _render(api_versions=("cert-manager.io/v1",))
    assert not [d for d in docs if d["kind"] == "Secret" and "etcd" in d["metadata"]["name"]]
    certs = {d["spec"]["secretName"]: d["spec"] for d in docs if d["kind"] == "Certificate"}
    assert certs["t-tandem-etcd-router-tls"]["commonName"] == etcd_auth.ROUTER_USER
    assert certs["t-tandem-etcd-operator-tls"]["commonName"] == etcd_auth.OPERATOR_USER
    assert certs["t-tandem-registry-signing"]["privateKey"] == {"algorithm": "Ed25519", "rotationPolicy": "Never"}
    assert "t-tandem-etcd-serving.svc" not in certs["t-tandem-etcd-server-tls"]["dnsNames"]
    assert "t-tandem-etcd.serving.svc" in certs["t-tandem-etcd-server-tls"]["dnsNames"]
    issuer = _render("etcd.tls.issuer=corp-ca", api_versions=("cert-manager.io/v1",))
    assert not [d for d in issuer if d["kind"] == "Issuer"]


def test_tls_off_or_external_etcd_render_as_before() -> None:
    for sets in (("etcd.tls.enabled=false",), ("etcd.mode=external", "etcd.endpoints[0]=etcd.example:2379")):
        docs = _render(*sets)
        assert not [d for d in docs if d["kind"] in {"Secret", "Job", "Certificate"}]
        assert not [a for a in _args(docs, "-router") if a.startswith("--etcd-cert-file")]


@pytest.mark.procs
def test_generated_pki_and_job_secure_a_real_etcd(tmp_path: Path) -> None:
    docs = _render()
    files: dict[str, dict[str, Path]] = {}
    for secret in (d for d in docs if d["kind"] == "Secret"):
        name = secret["metadata"]["name"].removeprefix("t-tandem-")
        files[name] = {}
        for key, value in secret["data"].items():
            path = tmp_path / f"{name}-{key}"
            path.write_bytes(base64.b64decode(value))
            files[name][key] = path
    port, peer = free_port(), free_port()
    server = files["etcd-server-tls"]
    url = f"https://127.0.0.1:{port}"
    etcd_bin = shutil.which("etcd")
    assert etcd_bin is not None, "etcd is not installed (scripts/bootstrap.sh installs etcd-server)"
    argv = [
        etcd_bin, "--data-dir", str(tmp_path / "data"), "--listen-client-urls", url, "--advertise-client-urls", url,
        "--listen-peer-urls", f"http://127.0.0.1:{peer}", "--initial-advertise-peer-urls", f"http://127.0.0.1:{peer}",
        "--initial-cluster", f"default=http://127.0.0.1:{peer}", "--cert-file", str(server["tls.crt"]),
        "--key-file", str(server["tls.key"]), "--trusted-ca-file", str(server["ca.crt"]), "--client-cert-auth",
    ]  # fmt: skip
    proc = ManagedProcess("etcd", argv, tmp_path / "etcd.log").start()
    try:
        [job] = [d for d in docs if d["kind"] == "Job"]
        job_args = job["spec"]["template"]["spec"]["containers"][0]["args"]
        root = files["etcd-root-tls"]
        local = {"/etc/tandem/etcd/ca.crt": root["ca.crt"], "/etc/tandem/etcd/tls.crt": root["tls.crt"]}
        local["/etc/tandem/etcd/tls.key"] = root["tls.key"]
        argv = []
        for arg in job_args[1:]:
            flag, _, value = arg.partition("=")
            value = str(local.get(value, value))
            argv.append(f"{flag}={f'127.0.0.1:{port}' if flag == '--etcd-endpoint' else value}")
        assert etcd_auth.main([*argv, "--wait-s=30"]) == 0
        asyncio.run(_check_roles(f"127.0.0.1:{port}", files))
    finally:
        proc.stop()


def _tls(files: dict[str, dict[str, Path]], name: str) -> EtcdTLS:
    pair = files[name]
    return EtcdTLS(ca_file=str(pair["ca.crt"]), cert_file=str(pair["tls.crt"]), key_file=str(pair["tls.key"]))


async def _check_roles(endpoint: str, files: dict[str, dict[str, Path]]) -> None:
    signing = files["registry-signing"]
    ep = Endpoint(role=Role.DECODE, group="decode-0", url="http://10.0.0.1:30000", model="m")
    key = registry.endpoint_key("serving", "kimi-k26", ep)
    signed = EndpointSigner.from_file(signing["tls.key"]).sign(key, ep)
    assert EndpointVerifier.from_file(signing["tls.crt"]).verify(key, signed)
    operator = client([endpoint], tls=_tls(files, "etcd-operator-tls"))
    router = client([endpoint], tls=_tls(files, "etcd-router-tls"))
    await operator.connect()
    await router.connect()
    try:
        await operator.put(key.encode(), registry.encode(signed))
        with pytest.raises(EtcdError, match="permission denied"):
            await router.put(key.encode(), registry.encode(ep))
        assert registry.decode((await router.get(key.encode())).value) == signed
    finally:
        await operator.close()
        await router.close()
