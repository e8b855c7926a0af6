"""The operator's REST client against a local HTTP(S) server: what goes on the wire (method, path, query, headers,
JSON body, bearer token read afresh), what comes back (decoded JSON, ``ApiError`` with the Status message), and TLS
with the dev cluster's kind of kubeconfig (CA file, client certificate and key)."""

from __future__ import annotations

import json
import ssl
from collections.abc import AsyncIterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import aiohttp
import pytest
from aiohttp import web

from tandem.kube.credentials import Credentials, from_kubeconfig
from tandem.kube.rest import ApiError, RestClient
from tandem_dev.devcluster import pki
from tandem_dev.devcluster.kubeconfig import kubeconfig, write_kubeconfig
from tandem_dev.procs import free_port
from tandem_operator.act.k8s.apply import apply_request
from tandem_operator.act.k8s.kube import Kube, NotFoundError, TemporaryError


@dataclass
class Server:
    url: str
    seen: list[dict[str, Any]] = field(default_factory=list)
    answers: list[web.Response] = field(default_factory=list)  # the next answers, else 200 {"ok": true}


async def _start(ssl_context: ssl.SSLContext | None = None) -> tuple[Server, web.AppRunner]:
    port = free_port()
    server = Server(f"{'https' if ssl_context else 'http'}://127.0.0.1:{port}")

    async def handle(request: web.Request) -> web.Response:
        peer = request.transport.get_extra_info("peercert") if request.transport else None
        server.seen.append(
            {
                "method": request.method,
                "path": request.path,
                "query": list(request.query.items()),
                "headers": dict(request.headers),
                "body": await request.read(),
                "peer": peer,
            }
        )
        return server.answers.pop(0) if server.answers else web.json_response({"ok": True})

    app = web.Application()
    app.router.add_route("*", "/{tail:.*}", handle)
    runner = web.AppRunner(app, access_log=None)
    await runner.setup()
    await web.TCPSite(runner, "127.0.0.1", port, ssl_context=ssl_context).start()
    return server, runner


@pytest.fixture
async def server() -> AsyncIterator[Server]:
    started, runner = await _start()
    yield started
    await runner.cleanup()


async def test_an_apply_goes_out_as_json_with_the_token_read_for_each_request(server: Server, tmp_path: Path) -> None:
    token = tmp_path / "token"
    token.write_text("first")
    manifest = {"apiVersion": "v1", "kind": "Service", "metadata": {"name": "s", "namespace": "ns"}}
    async with RestClient(Credentials(server=server.url, token_path=str(token))) as rest:
        assert await rest.send(apply_request(manifest)) == {"ok": True}
        token.write_text("second")
        await Kube(rest).list("v1", "Pod", "ns", "tandem.dev/cluster=sim,tandem.dev/role")
    apply, listed = server.seen
    assert (apply["method"], apply["path"]) == ("PATCH", "/api/v1/namespaces/ns/services/s")
    assert apply["query"] == [("fieldManager", "tandem-operator"), ("force", "true")]
    assert apply["headers"]["Content-Type"] == "application/apply-patch+yaml"
    assert apply["headers"]["Accept"] == "application/json"
    assert apply["headers"]["Authorization"] == "Bearer first"
    assert json.loads(apply["body"]) == manifest
    assert listed["query"] == [("labelSelector", "tandem.dev/cluster=sim,tandem.dev/role"), ("limit", "50")]
    assert (listed["headers"]["Authorization"], listed["body"]) == ("Bearer second", b"")


async def test_error_statuses_carry_the_status_message_and_map_to_the_operators_errors(server: Server) -> None:
    status = {"kind": "Status", "message": 'pods "p" not found', "code": 404}
    server.answers = [
        web.json_response(status, status=404),
        web.Response(status=503, text="overloaded"),
        web.json_response(status, status=404),
        web.Response(status=204),
    ]
    async with RestClient(Credentials(server=server.url)) as rest:
        with pytest.raises(ApiError) as err:
            await rest.send(
                apply_request({"apiVersion": "v1", "kind": "Pod", "metadata": {"name": "p", "namespace": "n"}})
            )
        assert (err.value.status, err.value.reason, err.value.message) == (404, "Not Found", 'pods "p" not found')
        with pytest.raises(ApiError) as err:
            await rest.send(
                apply_request({"apiVersion": "v1", "kind": "Pod", "metadata": {"name": "p", "namespace": "n"}})
            )
        assert (err.value.status, err.value.message) == (503, "")
        kube = Kube(rest, backoff_s=0.001)
        with pytest.raises(NotFoundError, match='pods "p" not found'):
            await kube.put("/api/v1/namespaces/n/pods/p", {})
        assert await kube.post("/api/v1/namespaces/n/events", {}) is None  # an empty answer
    assert "Authorization" not in server.seen[0]["headers"]  # no credentials, no header


async def test_a_lost_connection_is_temporary_and_retried() -> None:
    url = f"http://127.0.0.1:{free_port()}"  # nothing listens
    async with RestClient(Credentials(server=url)) as rest:
        with pytest.raises(aiohttp.ClientConnectionError):
            await rest.send(
                apply_request({"apiVersion": "v1", "kind": "Pod", "metadata": {"name": "p", "namespace": "n"}})
            )
        counted: list[str] = []
        with pytest.raises(TemporaryError) as err:
            await Kube(rest, backoff_s=0.001, on_request=counted.append).get("/api/v1/namespaces/n/pods/p")
    assert err.value.status == 0
    assert counted == ["GET"] * 4


async def test_tls_with_a_kubeconfig_client_certificate(tmp_path: Path) -> None:
    ca = pki.create_ca(tmp_path)
    serving = pki.issue_serving_cert(ca, tmp_path, "apiserver", ["127.0.0.1"], [])
    context = ssl.create_default_context(ssl.Purpose.CLIENT_AUTH, cafile=str(ca.cert))
    context.load_cert_chain(serving.cert, serving.key)
    context.verify_mode = ssl.CERT_REQUIRED  # as kube-apiserver with --client-ca-file
    server, runner = await _start(context)
    try:
        user = pki.issue_client_cert(ca, tmp_path, "tandem-admin", ["system:masters"])
        doc = kubeconfig(server.url, ca.cert, "tandem-admin", client_cert=user.cert, client_key=user.key)
        credentials = from_kubeconfig(str(write_kubeconfig(tmp_path / "config", doc)))
        async with RestClient(credentials) as rest:
            assert await Kube(rest).get("/api/v1/namespaces/default") == {"ok": True}
        subject = dict(pair[0] for pair in server.seen[0]["peer"]["subject"])
        assert subject["commonName"] == "tandem-admin"
    finally:
        await runner.cleanup()
