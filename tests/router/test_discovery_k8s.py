"""The router's ``KubernetesDiscovery`` against the real test control plane, through a TCP proxy the test can cut.

While the proxy is cut (every connection to the API server dropped and refused, as in an API server restart or
a network blip), a pod is deleted and another created; after the gap the pool must equal the pods that exist:
the deleted pod's DELETED event was never delivered, so only a re-listing can drop it.
"""

from __future__ import annotations

import asyncio
import contextlib
from collections.abc import AsyncIterator
from pathlib import Path
from typing import Any
from urllib.parse import urlsplit

import pytest
import yaml
from kubernetes_asyncio import client

from tandem.registry import Role
from tandem_dev.devcluster.cluster import DevCluster
from tandem_dev.devcluster.nodes import GPU_RESOURCE
from tandem_router.config import DiscoveryMode, RouterSettings
from tandem_router.discovery import KubernetesDiscovery
from tandem_router.pool import WorkerPool
from tests.tandem_dev.devcluster.devcluster_fixtures import create, eventually

pytestmark = [pytest.mark.k8s, pytest.mark.timeout(180)]
PORT = 30000


class CuttableProxy:
    """A loopback TCP proxy to the API server; ``cut`` drops every connection and refuses new ones until
    ``resume``."""

    def __init__(self, host: str, port: int) -> None:
        self.host, self.port = host, port
        self.open = True
        self._writers: set[asyncio.StreamWriter] = set()
        self._server: asyncio.Server | None = None

    async def start(self) -> int:
        self._server = await asyncio.start_server(self._accept, "127.0.0.1", 0)
        port: int = self._server.sockets[0].getsockname()[1]
        return port

    def cut(self) -> None:
        self.open = False
        for writer in list(self._writers):
            writer.transport.abort()

    def resume(self) -> None:
        self.open = True

    async def close(self) -> None:
        self.cut()
        if self._server is not None:
            self._server.close()
            await self._server.wait_closed()

    async def _accept(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        if not self.open:
            writer.transport.abort()
            return
        up_reader, up_writer = await asyncio.open_connection(self.host, self.port)
        self._writers |= {writer, up_writer}
        try:
            await asyncio.gather(self._pipe(reader, up_writer), self._pipe(up_reader, writer))
        finally:
            for w in (writer, up_writer):
                self._writers.discard(w)
                w.transport.abort()

    async def _pipe(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        with contextlib.suppress(ConnectionError, OSError):
            while data := await reader.read(65536):
                writer.write(data)
                await writer.drain()
        writer.transport.abort()


@pytest.fixture
async def proxy(k8s_cluster: DevCluster) -> AsyncIterator[CuttableProxy]:
    target = urlsplit(k8s_cluster.server)
    assert target.hostname is not None
    assert target.port is not None
    p = CuttableProxy(target.hostname, target.port)
    yield p
    await p.close()


def _pod(name: str, role: Role) -> dict[str, Any]:
    return {
        "apiVersion": "v1",
        "kind": "Pod",
        "metadata": {"name": name, "labels": {"test-role": role.value}},
        "spec": {"containers": [{"name": "w", "image": "registry.invalid/w:1",
                                 "resources": {"limits": {GPU_RESOURCE: "1"}}}]},
    }  # fmt: skip


async def test_pod_discovery_relists_after_a_watch_gap(
    k8s_cluster: DevCluster, k8s_api: client.ApiClient, k8s_namespace: str, proxy: CuttableProxy, tmp_path: Path
) -> None:
    core = client.CoreV1Api(k8s_api)
    ns = k8s_namespace

    async def ready_ip(name: str) -> str | None:
        pod = await core.read_namespaced_pod(name, ns)
        ready = any(c.type == "Ready" and c.status == "True" for c in pod.status.conditions or ())
        return f"http://{pod.status.pod_ip}:{PORT}" if ready and pod.status.pod_ip else None

    async def started(name: str, role: Role) -> str:
        await create(k8s_api, ns, _pod(name, role))
        return await eventually(lambda: ready_ip(name), f"pod {name} Ready with an IP", within=60)

    urls = {name: await started(name, role) for name, role in
            (("prefill-a", Role.PREFILL), ("decode-a", Role.DECODE), ("decode-b", Role.DECODE))}  # fmt: skip

    config = yaml.safe_load(k8s_cluster.kubeconfig.read_text())
    config["clusters"][0]["cluster"]["server"] = f"https://127.0.0.1:{await proxy.start()}"
    kubeconfig = tmp_path / "through-proxy.kubeconfig"
    kubeconfig.write_text(yaml.safe_dump(config))
    settings = RouterSettings(
        discovery=DiscoveryMode.KUBERNETES, k8s_namespace=ns, k8s_worker_port=PORT,
        k8s_prefill_selector="test-role=prefill", k8s_decode_selector="test-role=decode",
    )  # fmt: skip
    pool = WorkerPool()
    discovery = KubernetesDiscovery(pool, settings, kubeconfig=str(kubeconfig), retry_s=0.5)

    async def pool_is(expected: set[str]) -> bool:
        return {w.spec.url for w in pool.workers.values()} == expected

    await discovery.start()
    try:
        await eventually(lambda: pool_is(set(urls.values())), "the listed pods in the pool")
        urls["decode-c"] = await started("decode-c", Role.DECODE)
        await eventually(lambda: pool_is(set(urls.values())), "a watched new pod in the pool")

        listings = discovery.listings
        proxy.cut()  # the watches break; the router cannot reach the API server until resume()
        urls["decode-d"] = await started("decode-d", Role.DECODE)  # before the delete: it cannot reuse a's IP
        await core.delete_namespaced_pod("decode-a", ns, grace_period_seconds=0)
        gone = urls.pop("decode-a")
        assert gone not in urls.values()

        async def deleted() -> bool:
            names = {p.metadata.name for p in (await core.list_namespaced_pod(ns)).items}
            return "decode-a" not in names

        await eventually(deleted, "decode-a deleted")
        await asyncio.sleep(1.0)  # a few refused reconnections
        assert gone in {w.spec.url for w in pool.workers.values()}  # nothing could tell the router yet
        proxy.resume()

        await eventually(lambda: pool_is(set(urls.values())), "the pool equal to the pods after the gap")
        assert discovery.listings >= listings + 2  # both roles listed again
        urls["decode-e"] = await started("decode-e", Role.DECODE)
        await eventually(lambda: pool_is(set(urls.values())), "watch events again after the re-listing")
    finally:
        await discovery.stop()
