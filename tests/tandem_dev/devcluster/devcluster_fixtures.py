"""Fixtures for tests on the real test control plane (``@pytest.mark.k8s``).

``k8s_cluster`` starts etcd, kube-apiserver, kube-controller-manager, kube-scheduler and kwok once per session
and stops them at the end, whatever happened. When a test that used it fails, the report names the cluster's
log directory (kept under pytest's basetemp) and shows the tail of every component's log.
"""

from __future__ import annotations

import asyncio
import atexit
import uuid
from collections.abc import AsyncIterator, Awaitable, Callable, Generator, Iterator
from typing import TYPE_CHECKING, Any, TypeVar

import pytest
import pytest_asyncio

from tandem_dev.devcluster.cluster import DevCluster
from tandem_dev.devcluster.config import DevClusterConfig

if TYPE_CHECKING:  # imported where used: this plugin loads in every session, `make unit`'s included (~0.8 s CPU)
    from kubernetes_asyncio import client

CLUSTER_NODES = 8
T = TypeVar("T")
_started: list[DevCluster] = []


@pytest.fixture(scope="session")
def k8s_cluster(tmp_path_factory: pytest.TempPathFactory) -> Iterator[DevCluster]:
    """A running control plane with ``CLUSTER_NODES`` fake 8-GPU nodes (4 per topology block)."""
    cluster = DevCluster(tmp_path_factory.mktemp("k8s"), DevClusterConfig(nodes=CLUSTER_NODES))
    _started.append(cluster)
    atexit.register(cluster.stop)  # also when the session is interrupted before fixture teardown
    cluster.start()
    yield cluster
    cluster.stop()


@pytest_asyncio.fixture
async def k8s_api(k8s_cluster: DevCluster) -> AsyncIterator[client.ApiClient]:
    """An admin (system:masters) kubernetes_asyncio client, on the test's own event loop."""
    from kubernetes_asyncio import config as kube_config

    api = await kube_config.new_client_from_config(config_file=str(k8s_cluster.kubeconfig))
    yield api
    await api.close()


@pytest_asyncio.fixture
async def k8s_namespace(k8s_api: client.ApiClient) -> AsyncIterator[str]:
    """A fresh namespace for one test, deleted afterwards (with everything in it)."""
    from kubernetes_asyncio import client

    core = client.CoreV1Api(k8s_api)
    name = f"t-{uuid.uuid4().hex[:8]}"
    await core.create_namespace(client.V1Namespace(metadata=client.V1ObjectMeta(name=name)))
    # Pods need the namespace's default ServiceAccount, which the controller-manager creates.
    for _ in range(100):
        accounts = await core.list_namespaced_service_account(name)
        if any(sa.metadata.name == "default" for sa in accounts.items):
            break
        await asyncio.sleep(0.1)
    yield name
    await core.delete_namespace(name)


def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    """Run ``k8s`` tests last in a serial session, so the control plane starts late and its idle CPU use never
    overlaps the timing-sensitive tests of the rest of the suite (it stops at session end, right after them).
    Under pytest-xdist (``make test``) they run first, on one worker, while the other takes the rest of the suite
    (``--no-loadscope-reorder`` keeps this order): they are the longest chain of the suite."""
    under_xdist = hasattr(config, "workerinput")
    items.sort(key=lambda item: (item.get_closest_marker("k8s") is not None) != under_xdist)


def _log_tails(cluster: DevCluster, lines: int = 15) -> str:
    parts = [f"component logs: {cluster.layout.logs}"]
    for name, path in cluster.logs().items():
        try:
            tail = path.read_text(errors="replace").splitlines()[-lines:]
        except FileNotFoundError:
            tail = ["(no log)"]
        parts.append(f"--- {name} ({path}) ---\n" + "\n".join(tail))
    return "\n".join(parts)


@pytest.hookimpl(wrapper=True)
def pytest_runtest_makereport(
    item: pytest.Item, call: pytest.CallInfo[None]
) -> Generator[None, pytest.TestReport, pytest.TestReport]:
    report = yield
    if report.failed and "k8s_cluster" in getattr(item, "fixturenames", ()) and _started:
        report.sections.append(("dev cluster logs", _log_tails(_started[-1])))
    return report


async def eventually(check: Callable[[], Awaitable[T | None]], what: str, within: float = 30.0) -> T:
    """Poll ``check`` until it returns something other than None/False; fail naming ``what`` after ``within`` s."""
    try:
        async with asyncio.timeout(within):
            while True:
                result = await check()
                if result is not None and result is not False:
                    return result
                await asyncio.sleep(0.2)
    except TimeoutError:
        raise AssertionError(f"timed out after {within}s waiting for {what}") from None


async def create(api: client.ApiClient, namespace: str, manifest: dict[str, Any]) -> Any:
    """Create one object from a manifest dict (apiVersion + kind pick the API); returns the created object."""
    from kubernetes_asyncio import utils as kube_utils

    (created,) = await kube_utils.create_from_dict(api, manifest, namespace=namespace)
    return created
