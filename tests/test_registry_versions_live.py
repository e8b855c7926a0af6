"""Mixed schema versions against a real etcd and router (the `tandem up` stack: TLS, roles, signed endpoints): an
entry one version ahead with a member the router does not know is routed to and counted as ``newer``; one two
versions ahead is refused for its worker only, logged with its key; changing the unknown member without the
operator's key takes the worker out (the signature covers it)."""

from __future__ import annotations

import asyncio
import base64
import json
from pathlib import Path
from typing import Any

import aiohttp
import pytest
from cryptography.hazmat.primitives import serialization
from cryptography.hazmat.primitives.asymmetric.ed25519 import Ed25519PrivateKey

from tandem import registry
from tandem.etcd_auth import OPERATOR_USER
from tandem.registry_etcd import client
from tandem.registry_versions import SCHEMA_VERSION, canonical
from tandem_dev.etcd_pki import EtcdPki
from tandem_dev.local_stack import CLUSTER, MODEL, NAMESPACE, etcd_pki_of, instant_worker_argv
from tandem_dev.stack_fixture import running_stack
from tests.plumbing.routermetrics import scrape
from tests.tandem_dev.devcluster.devcluster_fixtures import eventually

pytestmark = pytest.mark.procs


def _signed(private: Ed25519PrivateKey, key: str, obj: dict[str, Any]) -> bytes:
    """``obj`` as a writer of a later version signs it (the rule every version from 2 on keeps)."""
    payload = key.encode() + b"\n" + canonical({k: v for k, v in obj.items() if k != "signature"})
    return json.dumps({**obj, "signature": base64.b64encode(private.sign(payload)).decode()}).encode()


def test_a_newer_entry_is_routed_to_and_a_too_new_one_refused(tmp_path: Path) -> None:
    # Without the removal-storm guard: two of four workers leave within its window here (refused, then forged), which
    # it would hold while healthy (router/README.md, "Registry outages").
    no_guard = ["--registry-panic-min-removals", "1000"]
    with running_stack(
        tmp_path, router_port=0, worker_argv=instant_worker_argv, restart=False, router_args=no_guard
    ) as stack:
        decode0, decode1 = (w for w in stack.workers if w.group.startswith("decode"))
        pki = etcd_pki_of(tmp_path)
        private = serialization.load_pem_private_key(Path(pki.signing_key).read_bytes(), password=None)
        assert isinstance(private, Ed25519PrivateKey)
        asyncio.run(_scenario(stack.router_url, stack.etcd_endpoints, pki, private, decode0.url, decode1.url))
        log = [json.loads(line) for line in (tmp_path / "router.log").read_text().splitlines() if line.startswith("{")]
    refused = [r for r in log if r.get("msg", "").startswith("registry entry refused")]
    assert refused, "no refusal logged"
    assert refused[0]["key"] == f"{registry.cluster_prefix(NAMESPACE, CLUSTER)}decode/decode-1"
    assert (refused[0]["reason"], refused[0]["schema_version"]) == ("too_new", SCHEMA_VERSION + 2)


async def _scenario(
    router_url: str, endpoints: list[str], pki: EtcdPki, private: Ed25519PrivateKey, ahead_url: str, too_new_url: str
) -> None:
    before = await scrape(router_url)
    assert before.schemas == {"older": 0, "current": 4, "newer": 0, "unsupported": 0}
    etcd = client(endpoints, tls=pki.client_tls(OPERATOR_USER))
    await etcd.connect()
    try:
        prefix = registry.cluster_prefix(NAMESPACE, CLUSTER)
        stored = {}
        for group in ("decode-0", "decode-1"):
            stored[group] = json.loads((await etcd.get(f"{prefix}decode/{group}".encode())).value)
            assert stored[group]["schema_version"] == SCHEMA_VERSION
        # decode-0 as the next version writes it: every member of this one, plus one the router does not know
        ahead = {**stored["decode-0"], "schema_version": SCHEMA_VERSION + 1, "kv_layout": {"page": 64}}
        await etcd.put(f"{prefix}decode/decode-0".encode(), _signed(private, f"{prefix}decode/decode-0", ahead))
        # decode-1 two versions ahead (a breaking change): refused, its worker leaves, the others stay
        too_new = {**stored["decode-1"], "schema_version": SCHEMA_VERSION + 2}
        await etcd.put(f"{prefix}decode/decode-1".encode(), _signed(private, f"{prefix}decode/decode-1", too_new))

        async def mixed() -> bool:
            seen = await scrape(router_url)
            return seen.schemas == {"older": 0, "current": 2, "newer": 1, "unsupported": 1}

        await eventually(mixed, "the router counting one newer and one unsupported entry", within=20)
        seen = await scrape(router_url)
        assert seen.refused_entries["too_new"] >= 1
        assert seen.forged_endpoints == 0
        assert ahead_url in seen.in_flight
        assert too_new_url not in seen.in_flight
        async with aiohttp.ClientSession() as http:  # decode-0, one version ahead, is the only decode left
            served = {url: await _served(http, url) for url in (ahead_url, too_new_url)}
            body = {"model": MODEL, "messages": [{"role": "user", "content": "hi"}], "max_tokens": 4}
            for _ in range(4):
                async with http.post(f"{router_url}/v1/chat/completions", json=body) as resp:
                    assert resp.status == 200, await resp.text()
            assert {url: await _served(http, url) - n for url, n in served.items()} == {ahead_url: 4, too_new_url: 0}

        # the unknown member changed by someone without the operator's key: not what the operator signed
        tampered = json.loads(_signed(private, f"{prefix}decode/decode-0", ahead)) | {"kv_layout": {"page": 1}}
        await etcd.put(f"{prefix}decode/decode-0".encode(), json.dumps(tampered).encode())

        async def forged() -> bool:
            return (await scrape(router_url)).forged_endpoints >= 1

        await eventually(forged, "the router refusing the tampered entry's signature", within=20)
        assert ahead_url not in (await scrape(router_url)).in_flight
    finally:
        await etcd.close()


async def _served(http: aiohttp.ClientSession, worker_url: str) -> int:
    """Requests an instant worker has served (its ``GET /_requests``)."""
    async with http.get(f"{worker_url}/_requests") as resp:
        return int((await resp.json())["total"])
