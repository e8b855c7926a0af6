"""Peer weight loading on the dev cluster (issue #35 item 5): real kube-apiserver, the operator, simulated workers
behind pod IPs (``tandem sim`` implements SGLang's remote-instance transfer-engine loader and seed).

A decode group killed while another serves comes back with the remote-instance flags pointing at the serving one
(and serves: its weights came over Mooncake from the seed); killed when the only other group loaded from a peer
(so publishes nothing) it comes back from the node's copy; and a seed that can seed again after its own
recreation is found at its new address.
"""

from __future__ import annotations

import functools
from typing import Any

import pytest
from kubernetes_asyncio import client

from tandem_dev.devcluster.podrunner import PodRunner
from tests.operator.live import Live, Registry, create_pdcluster, operator_process, pdcluster, pods
from tests.tandem_dev.devcluster.devcluster_fixtures import eventually

pytestmark = [pytest.mark.k8s, pytest.mark.netns, pytest.mark.slow, pytest.mark.timeout(300)]
ONE_NODE = {"groups": 2, "nodesPerGroup": 1, "gpusPerNode": 1, "tpSize": 1, "epSize": 1, "moeA2ABackend": "none"}
SEED_IP = "--remote-instance-weight-loader-seed-instance-ip"
SEED_PORT = "--remote-instance-weight-loader-seed-instance-service-port"


def flag(args: list[str], name: str) -> str | None:
    return args[args.index(name) + 1] if name in args else None


async def leader(api: client.ApiClient, ns: str, index: int) -> Any | None:
    found = await pods(api, ns, f"tandem.dev/role=decode,tandem.dev/group={index}")
    return found[0] if len(found) == 1 else None


async def _registered_after(reg: Registry, ns: str, epochs: dict[str, int]) -> dict[str, Any] | None:
    """The registry's entries once all three groups are registered, each past its epoch in ``epochs``."""
    found = await reg.endpoints(ns, "sim")
    fine = all(g in found and found[g].epoch > e for g, e in epochs.items())
    return found if fine and sorted(found) == ["decode-0", "decode-1", "prefill-0"] else None


async def test_a_killed_decode_loads_from_a_serving_peer_and_without_one_from_the_node(
    live: Live, runner: PodRunner
) -> None:
    ns, api = live.ns, live.api
    live.procs.append(operator_process(live.cluster, ns, live.etcd, live.tmp, "op-peer").start())
    await create_pdcluster(api, ns, pdcluster("sim", decode=ONE_NODE, peerLoading={"enabled": True}))
    core = client.CoreV1Api(api)
    async with Registry(live.etcd) as reg:
        registered_after = functools.partial(_registered_after, reg, ns)

        async def recreated(before: dict[str, Any], index: int) -> tuple[dict[str, Any], Any]:
            """Decode group ``index``'s pod deleted: the registry once it is back, and its new leader pod."""
            group = f"decode-{index}"
            await core.delete_namespaced_pod(f"sim-{group}-0", ns, grace_period_seconds=0)
            after = await eventually(
                lambda: registered_after({group: before[group].epoch}), f"{group} registered again", 90
            )
            pod = await leader(api, ns, index)
            assert pod is not None
            return after, pod

        endpoints = await eventually(lambda: registered_after({}), "prefill-0, decode-0, decode-1 registered", 90)
        first = {p.metadata.name: p for p in await pods(api, ns, "tandem.dev/role=decode")}
        for p in first.values():  # the first groups had no serving peer: from the node, started as seeds
            args = p.spec.containers[0].args
            assert "--remote-instance-weight-loader-start-seed-via-transfer-engine" in args
            assert "--load-format" not in args
            assert p.metadata.annotations["tandem.dev/weight-source"] == "node"

        # 1. decode-1 killed while decode-0 serves: it pulls its weights from decode-0
        seed = first["sim-decode-0-0"]
        endpoints, peer = await recreated(endpoints, 1)
        args = peer.spec.containers[0].args
        assert flag(args, "--load-format") == "remote_instance"
        assert flag(args, "--remote-instance-weight-loader-backend") == "transfer_engine"
        assert flag(args, SEED_IP) == seed.status.pod_ip
        assert flag(args, SEED_PORT) == "30001"
        assert peer.metadata.annotations["tandem.dev/weight-source"] == "peer"
        assert peer.metadata.annotations["tandem.dev/weight-seed"] == f"sim-decode-0/{endpoints['decode-0'].epoch}"
        assert peer.metadata.labels["tandem.dev/template-hash"] == seed.metadata.labels["tandem.dev/template-hash"]

        # 2. decode-0 killed: decode-1 serves but loaded from a peer, so it publishes nothing: from the node
        endpoints, back = await recreated(endpoints, 0)
        assert "--load-format" not in back.spec.containers[0].args
        assert back.metadata.annotations["tandem.dev/weight-source"] == "node"

        # 3. decode-1 killed again: decode-0's new incarnation (read from the node) seeds it at its new address
        endpoints, again = await recreated(endpoints, 1)
        assert flag(again.spec.containers[0].args, SEED_IP) == back.status.pod_ip
        assert again.metadata.annotations["tandem.dev/weight-seed"] == f"sim-decode-0/{endpoints['decode-0'].epoch}"
        status = await client.CustomObjectsApi(api).get_namespaced_custom_object(
            "tandem.dev", "v1alpha1", ns, "pdclusters", "sim"
        )
        outdated = next(c for c in status["status"]["conditions"] if c["type"] == "PodsOutdated")
        assert outdated["status"] == "False"  # the seeds chosen were never a change of the pods


# The kimi-k2.6-h200 profile's load phases at 1/25 of their time: a peer spends 0.6 s in init (after the process
# start) before it pulls, a load of the hub model about 23 s (simulator/README.md, load phases).
LOAD_PHASES = ["--sim-profile", "kimi-k2.6-h200", "--sim-load-phases", "--sim-time-factor", "0.04"]


async def test_a_seed_killed_while_a_peer_loads_from_it_the_peer_comes_back_from_the_node(
    live: Live, runner: PodRunner
) -> None:
    ns, api = live.ns, live.api
    live.procs.append(operator_process(live.cluster, ns, live.etcd, live.tmp, "op-peer-fail").start())
    decode = {**ONE_NODE, "extraArgs": LOAD_PHASES}
    await create_pdcluster(api, ns, pdcluster("sim", decode=decode, peerLoading={"enabled": True}))
    core = client.CoreV1Api(api)
    async with Registry(live.etcd) as reg:
        registered_after = functools.partial(_registered_after, reg, ns)
        before = await eventually(lambda: registered_after({}), "prefill-0, decode-0, decode-1 registered", 120)
        epoch = before["decode-1"].epoch
        await core.delete_namespaced_pod("sim-decode-1-0", ns, grace_period_seconds=0)

        async def loading_from_a_peer() -> Any | None:
            found = await leader(api, ns, 1)
            if found is None or int(found.metadata.annotations["tandem.dev/epoch"]) <= epoch:
                return None
            return found if "--load-format" in found.spec.containers[0].args else None

        peer = await eventually(loading_from_a_peer, "decode-1 recreated loading from decode-0", 60)
        await core.delete_namespaced_pod("sim-decode-0-0", ns, grace_period_seconds=0)  # the seed dies mid-load
        failed = int(peer.metadata.annotations["tandem.dev/epoch"])
        await eventually(
            lambda: registered_after({"decode-0": before["decode-0"].epoch, "decode-1": failed}),
            "decode-0 and decode-1 registered again",
            120,
        )
        back = await leader(api, ns, 1)
        assert back is not None
        assert "--load-format" not in back.spec.containers[0].args  # the node's copy
        assert back.metadata.annotations["tandem.dev/weight-source"] == "node"
        service = await core.read_namespaced_service("sim-decode-1", ns)
        assert service.metadata.annotations["tandem.dev/peer-load-failed"] == str(failed)
        seed = await leader(api, ns, 0)
        assert seed is not None
        assert "--load-format" not in seed.spec.containers[0].args  # no seed serving for it
