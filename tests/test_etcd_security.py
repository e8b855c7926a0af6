"""Only the operator may write the registry, and routers believe only what the operator signed.

Against a real etcd (Debian etcd-server) with server and peer TLS, client certificates and etcd's roles
(``tandem.etcd_auth``), as ``tandem up`` runs it: a client without a certificate, or with the router's, cannot
write an endpoint; the operator's registrar and the router work as before; an endpoint written with stolen write
access but without the operator's signature is ignored by the router, logged and counted.
"""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator, Iterator
from pathlib import Path
from typing import Any

import aiohttp
import pydantic
import pytest

from tandem import registry
from tandem.etcd_auth import OPERATOR_USER, ROOT_USER, ROUTER_USER, Access, Grant, auth_plan, prefix_end, setup_auth
from tandem.etcd_errors import EtcdError, EtcdUnavailableError
from tandem.registry import Endpoint, EtcdTLS, Role
from tandem.registry_etcd import client
from tandem.registry_signing import EndpointSigner, EndpointVerifier, write_keypair
from tandem_dev.etcd_pki import EtcdPki
from tandem_dev.local_stack import CLUSTER, MODEL, NAMESPACE, etcd_pki_of, instant_worker_argv, start_etcd
from tandem_dev.stack_fixture import running_stack
from tandem_operator.act.registrar import Registrar
from tandem_operator.decide.fencing import StaleKeys
from tandem_operator.decide.observe import GroupKey
from tandem_operator.run.main import parse_args as operator_args
from tandem_router.config import RouterEtcdSettings, RouterSettings
from tests.plumbing.routermetrics import scrape
from tests.tandem_dev.devcluster.devcluster_fixtures import eventually

NS, CL = "ns", "c1"


def _ep(group: str = "decode-0", url: str = "http://127.0.0.1:9") -> Endpoint:
    return Endpoint(role=Role.DECODE, group=group, url=url, model="m", epoch=1)


# -- pure --------------------------------------------------------------------------------------------------------


def test_router_role_reads_endpoints_and_writes_only_its_integrity_reports() -> None:
    plan = auth_plan([(NS, CL)])
    assert plan[ROUTER_USER] == {
        Grant(registry.cluster_prefix(NS, CL), Access.READ),
        Grant(registry.integrity_prefix(NS, CL), Access.READWRITE),
    }
    assert Grant(registry.ROOT + "/", Access.READWRITE) in plan[OPERATOR_USER]
    assert prefix_end(b"/a/") == b"/a0"
    assert prefix_end(b"a\xff") == b"b"


@pytest.fixture(scope="module")
def signer(tmp_path_factory: pytest.TempPathFactory) -> tuple[EndpointSigner, EndpointVerifier]:
    directory = tmp_path_factory.mktemp("keys")
    write_keypair(directory / "k", directory / "k.pub")
    return EndpointSigner.from_file(directory / "k"), EndpointVerifier.from_file(directory / "k.pub")


def test_signature_binds_the_value_to_its_key(signer: tuple[EndpointSigner, EndpointVerifier]) -> None:
    sign, verifier = signer
    key = registry.endpoint_key(NS, CL, _ep())
    signed = sign.sign(key, _ep())
    assert verifier.verify(key, signed)
    assert verifier.verify(key, registry.decode(registry.encode(signed)))  # survives the etcd round trip
    assert not verifier.verify(key, _ep())  # unsigned
    assert not verifier.verify(key, signed.model_copy(update={"url": "http://10.6.6.6:30000"}))  # tampered
    assert not verifier.verify(registry.endpoint_key(NS, "other", _ep()), signed)  # replayed under another key
    assert not verifier.verify(key, signed.model_copy(update={"signature": "bm90IGEgc2lnbmF0dXJl"}))
    assert not verifier.verify(key, signed.model_copy(update={"signature": "%%%"}))  # not base64


def test_bad_tls_settings_name_the_field(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    with pytest.raises(pydantic.ValidationError, match=r"etcd\.ca_file"):
        RouterSettings.model_validate({"etcd_ca_file": tmp_path / "missing.crt"})  # by the flag's name, as --config
    cert = tmp_path / "c.pem"
    cert.write_text("not a key")
    with pytest.raises(pydantic.ValidationError, match="cert_file and key_file go together"):
        RouterSettings(etcd=RouterEtcdSettings(ca_file=cert, cert_file=cert))
    with pytest.raises(pydantic.ValidationError, match="registry_verify_key"):
        RouterSettings(registry_verify_key=cert)
    with pytest.raises(SystemExit):
        operator_args(["--etcd-ca-file", str(tmp_path / "missing.crt"), "--no-leader-election"])
    assert "--etcd-ca-file: no such file" in capsys.readouterr().err


# -- a real etcd with TLS and roles ------------------------------------------------------------------------------


@pytest.fixture(scope="module")
def secure_etcd(tmp_path_factory: pytest.TempPathFactory) -> Iterator[tuple[str, EtcdPki]]:
    workdir = tmp_path_factory.mktemp("etcd")
    proc, endpoint = start_etcd(workdir, secure=True)
    pki = etcd_pki_of(workdir)
    asyncio.run(setup_auth([endpoint], pki.client_tls(ROOT_USER), [(NS, CL)]))
    yield endpoint, pki
    proc.stop()


@pytest.fixture
async def as_user(secure_etcd: tuple[str, EtcdPki]) -> AsyncIterator[Any]:
    endpoint, _ = secure_etcd
    opened: list[Any] = []

    async def connect(tls: EtcdTLS | None) -> Any:
        etcd = client([endpoint], timeout=3, tls=tls)
        opened.append(etcd)
        await etcd.connect()
        return etcd

    yield connect
    for etcd in opened:
        await etcd.close()


ENDPOINT_KEY = registry.endpoint_key(NS, CL, _ep()).encode()


@pytest.mark.procs
async def test_no_certificate_cannot_write_an_endpoint(secure_etcd: tuple[str, EtcdPki], as_user: Any) -> None:
    _, pki = secure_etcd
    for tls in (None, EtcdTLS(ca_file=str(pki.ca.cert))):  # plaintext; TLS without a client certificate
        etcd = await as_user(tls)
        with pytest.raises(EtcdUnavailableError):
            await etcd.put(ENDPOINT_KEY, registry.encode(_ep()))


@pytest.mark.procs
async def test_router_certificate_reads_but_cannot_write_endpoints(
    secure_etcd: tuple[str, EtcdPki], as_user: Any
) -> None:
    _, pki = secure_etcd
    operator = await as_user(pki.client_tls(OPERATOR_USER))
    await operator.put(ENDPOINT_KEY, registry.encode(_ep()))
    router = await as_user(pki.client_tls(ROUTER_USER))
    assert [kv.key for kv in await router.get_prefix(registry.cluster_prefix(NS, CL).encode())] == [ENDPOINT_KEY]
    for write in (
        router.put(ENDPOINT_KEY, registry.encode(_ep(url="http://10.6.6.6:30000"))),
        router.put(registry.endpoint_key(NS, CL, _ep("prefill-9")).encode(), b"{}"),
        router.delete(ENDPOINT_KEY),
        router.delete_prefix(registry.cluster_prefix(NS, CL).encode()),
        router.put(registry.integrity_key(NS, "other", "r").encode(), b"{}"),  # another cluster's reports
        router.get_prefix(registry.cluster_prefix(NS, "other").encode()),  # another cluster's endpoints
    ):
        with pytest.raises(EtcdError, match="permission denied"):
            await write
    lease = await router.lease(5)  # its own integrity report, under its own lease: allowed
    await router.put(registry.integrity_key(NS, CL, "r").encode(), b"{}", lease=lease)
    await lease.revoke()
    assert registry.decode((await operator.get(ENDPOINT_KEY)).value) == _ep()  # untouched


@pytest.mark.procs
async def test_operator_registrar_signs_and_adopts_only_signed_entries(
    secure_etcd: tuple[str, EtcdPki], as_user: Any
) -> None:
    endpoint, pki = secure_etcd
    sign = EndpointSigner.from_file(pki.signing_key)
    registrar = Registrar([endpoint], ttl=5, tls=pki.client_tls(OPERATOR_USER), signer=sign)
    await registrar.start()
    try:
        good, forged = _ep("decode-1"), _ep("decode-2")
        key = await registrar.put(NS, CL, good)
        stored = registry.decode((await (await as_user(pki.client_tls(ROUTER_USER))).get(key.encode())).value)
        assert EndpointVerifier.from_file(pki.verify_key).verify(key, stored)
        operator = await as_user(pki.client_tls(OPERATOR_USER))  # stolen write access, but not the signing key
        await operator.put(registry.endpoint_key(NS, CL, forged).encode(), registry.encode(forged))
        adopted = await registrar.list_endpoints(NS, CL)
        assert adopted.get(GroupKey(Role.DECODE, 1)) == good  # without its signature, as the deciders build it
        assert GroupKey(Role.DECODE, 2) not in adopted
        assert await registrar.fence(NS, CL, GroupKey(Role.DECODE, 1))
    finally:
        await registrar.remove_cluster(NS, CL)
        await registrar.close()


@pytest.mark.procs
async def test_operator_cleans_mooncake_keys_in_mooncakes_own_etcd(
    secure_etcd: tuple[str, EtcdPki], tmp_path: Path
) -> None:
    """A secured registry next to a plaintext etcd for Mooncake (spec.etcd.mooncakeEndpoints): the operator's
    stale-metadata cleanup after a fence goes to Mooncake's etcd."""
    endpoint, pki = secure_etcd
    mooncake_proc, mooncake = await asyncio.to_thread(start_etcd, tmp_path, "mooncake")
    registrar = Registrar([endpoint], tls=pki.client_tls(OPERATOR_USER), mooncake_endpoints=[mooncake])
    plain = client([mooncake])
    try:
        await registrar.start()
        await plain.connect()
        stale = ["mooncake/llm.kimi/rpc_meta/10.0.0.5", "mooncake/llm.kimi/ram/10.0.0.5:15100"]
        for key in stale:
            await plain.put(key.encode(), b"{}")
        removed = await registrar.delete_stale(
            StaleKeys(keys=(stale[0],), prefixes=("mooncake/llm.kimi/ram/10.0.0.5:",))
        )
        assert removed == 2
        assert list(await plain.get_prefix(b"mooncake/")) == []
    finally:
        await plain.close()
        await registrar.close()
        mooncake_proc.stop()


# -- the local stack (`tandem up`): routers ignore forged endpoints ----------------------------------------------


@pytest.mark.procs
def test_router_ignores_logs_and_counts_a_forged_endpoint(tmp_path: Path) -> None:
    with running_stack(tmp_path, router_port=0, worker_argv=instant_worker_argv, restart=False) as stack:
        victim = stack.workers[0]  # prefill-0
        asyncio.run(_forge(stack.router_url, stack.etcd_endpoints, etcd_pki_of(tmp_path), victim.url))
        assert stack.router is not None
        assert "without a valid operator signature ignored" in (tmp_path / "router.log").read_text()


async def _forge(router_url: str, endpoints: list[str], pki: EtcdPki, victim_url: str) -> None:
    assert victim_url in (await scrape(router_url)).in_flight
    etcd = client(endpoints, tls=pki.client_tls(OPERATOR_USER))  # stolen write access
    await etcd.connect()
    try:
        attacker = "http://127.0.0.1:9"
        new = Endpoint(role=Role.DECODE, group="decode-7", url=attacker, model=MODEL)
        await etcd.put(registry.endpoint_key(NAMESPACE, CLUSTER, new).encode(), registry.encode(new))
        # over a real worker's key, with a signature copied from another key: the worker goes, nothing replaces it
        real_key = f"{registry.cluster_prefix(NAMESPACE, CLUSTER)}prefill/prefill-0"
        current = registry.decode((await etcd.get(real_key.encode())).value)
        assert current.url == victim_url
        replaced = current.model_copy(update={"url": attacker})
        await etcd.put(real_key.encode(), registry.encode(replaced))

        async def counted() -> bool:
            return (await scrape(router_url)).forged_endpoints >= 2

        await eventually(counted, "the router counting both forged endpoints", within=20)
        seen = (await scrape(router_url)).in_flight
        assert attacker not in seen
        assert victim_url not in seen
        async with aiohttp.ClientSession() as http:  # the other, genuine workers still serve
            body = {"model": MODEL, "messages": [{"role": "user", "content": "hi"}], "max_tokens": 4}
            async with http.post(f"{router_url}/v1/chat/completions", json=body) as resp:
                assert resp.status == 200, await resp.text()
    finally:
        await etcd.close()
