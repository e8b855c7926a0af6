"""End to end on the real control plane: operator -> pods -> simulated workers -> etcd registry -> router -> the
``openai`` SDK, and a decode pod deleted under load.

The pod runner starts ``tandem sim`` behind each pod's IP; a real Mooncake engine (tests/operator/mooncake_peer.py)
publishes metadata in etcd under the victim pod's IP, as a worker with an etcd metadata server would, so the
cleanup of stale Mooncake keys is measured on Mooncake's own keys.
"""

from __future__ import annotations

import asyncio
import json
import os
import signal
import sys
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import openai
import pytest
from kubernetes_asyncio import client

from tandem_dev.devcluster.podrunner import PodRunner
from tandem_dev.procs import ManagedProcess, free_port
from tests.operator.live import (
    Live,
    Registry,
    create_pdcluster,
    operator_process,
    pdc_status,
    pdcluster,
    pods,
    router_process,
)
from tests.plumbing.routermetrics import scrape
from tests.tandem_dev.devcluster.devcluster_fixtures import eventually

pytestmark = [pytest.mark.k8s, pytest.mark.netns, pytest.mark.timeout(300)]
PEER = Path(__file__).with_name("mooncake_peer.py")
LOAD = Path(__file__).with_name("load_client.py")
MODEL = "kimi-k2.6-sim"
STREAMS, LOAD_SECONDS = 32, 10.0
STREAMING_BEFORE_KILL = 4  # streams past their first byte (router-wide) when the victim dies


@dataclass
class Load:
    ok: int = 0
    cut_mid_stream: int = 0  # failed after bytes had arrived: allowed (the dead worker was streaming them)
    failed_before_first_byte: list[str] = field(default_factory=list)


async def stream_once(sdk: openai.AsyncOpenAI, load: Load, n: int) -> None:
    received = False
    try:
        stream = await sdk.chat.completions.create(
            model=MODEL, messages=[{"role": "user", "content": f"count to {n}"}], max_tokens=16, stream=True
        )
        async for _ in stream:
            received = True
        load.ok += 1
    except openai.OpenAIError as err:
        if received:
            load.cut_mid_stream += 1
        else:
            load.failed_before_first_byte.append(repr(err))


async def test_a_decode_pod_deleted_under_load_is_fenced_cleaned_recreated_and_registered_again(
    live: Live,
    runner: PodRunner,
) -> None:
    ns = live.ns
    operator = operator_process(live.cluster, ns, live.etcd, live.tmp, "op-e2e").start()
    live.procs.append(operator)
    await create_pdcluster(live.api, ns, pdcluster("sim", decode_groups=2))

    async with Registry(live.etcd) as reg:

        async def all_registered() -> bool:
            return sorted(await reg.endpoints(ns, "sim")) == ["decode-0", "decode-1", "prefill-0"]

        await eventually(all_registered, "prefill-0, decode-0 and decode-1 registered", within=90)
        port = free_port()
        router = router_process(live.etcd, ns, "sim", port, live.tmp).start()
        live.procs.append(router)
        sdk = openai.AsyncOpenAI(base_url=f"http://127.0.0.1:{port}/v1", api_key="unused", max_retries=0, timeout=30)
        try:
            await _recover_under_load(live.api, ns, live.etcd, reg, sdk, live.tmp, live.procs)
        finally:
            await sdk.close()


async def _recover_under_load(
    k8s_api: client.ApiClient,
    ns: str,
    etcd_endpoint: str,
    reg: Registry,
    sdk: openai.AsyncOpenAI,
    tmp_path: Path,
    proc_factory: list[ManagedProcess],
) -> None:

    async def serves() -> bool:
        probe = Load()
        await stream_once(sdk, probe, 0)
        return probe.ok == 1

    await eventually(serves, "a completion through the router and the simulated workers", within=90)

    victim = next(p for p in await pods(k8s_api, ns) if p.metadata.name == "sim-decode-0-1")
    ip = victim.status.pod_ip
    root = f"mooncake/{ns}.sim/"
    env = {
        "MC_METADATA_CLUSTER_ID": f"{ns}.sim",
        "MC_MIN_RPC_PORT": "23000",
        "MC_MAX_RPC_PORT": "23999",
        "PYTHONPATH": os.pathsep.join(sys.path),
    }
    # It runs beside the pod (its IP lives in the pod's own network namespace), publishing under the pod's IP.
    argv = [sys.executable, str(PEER), ip, etcd_endpoint.split("://", 1)[1]]
    peer = ManagedProcess("mooncake-victim", argv, tmp_path / "peer.log", env=env).start()
    proc_factory.append(peer)

    async def mooncake_keys() -> list[str]:
        kvs = await reg.client.get_prefix(root.encode())
        return [kv.key.decode() for kv in kvs if kv.key.decode().split("/")[-1].split(":")[0] == ip]

    async def published() -> list[str] | None:
        keys = await mooncake_keys()
        return keys if len(keys) >= 2 else None  # rpc_meta and ram

    await eventually(published, "the victim's Mooncake metadata in etcd", within=30)
    epoch_before = (await reg.endpoints(ns, "sim"))["decode-0"].epoch
    victim_url = (await reg.endpoints(ns, "sim"))["decode-0"].url
    router_url = str(sdk.base_url).removesuffix("/").removesuffix("/v1")

    traffic = await asyncio.create_subprocess_exec(
        sys.executable,
        str(LOAD),
        str(sdk.base_url),
        MODEL,
        str(STREAMS),
        str(LOAD_SECONDS),
        stdout=asyncio.subprocess.PIPE,
        env={**os.environ, "PYTHONPATH": os.pathsep.join(sys.path)},
    )

    async def streams_on_the_victim() -> bool:  # what the router itself counts, not a guess after a fixed sleep
        metrics = await scrape(router_url)
        return metrics.streaming >= STREAMING_BEFORE_KILL and metrics.in_flight.get(victim_url, 0) >= 1

    await eventually(
        streams_on_the_victim, "streams in flight through the router and on decode-0", within=LOAD_SECONDS + 10
    )
    peer.signal(signal.SIGKILL)  # the pod's worker dies first (its Mooncake keys stay behind, as after a crash)
    deleted = time.monotonic()
    await client.CoreV1Api(k8s_api).delete_namespaced_pod("sim-decode-0-1", ns)
    fenced_s = cleaned_s = None
    async with asyncio.timeout(10):
        while fenced_s is None or cleaned_s is None:
            now = time.monotonic() - deleted
            current = (await reg.endpoints(ns, "sim")).get("decode-0")
            if fenced_s is None and (current is None or current.epoch > epoch_before):  # gone (or already back)
                fenced_s = now
            if cleaned_s is None and not await mooncake_keys():
                cleaned_s = now
            await asyncio.sleep(0.005)

    async def registered_again() -> int | None:
        endpoint = (await reg.endpoints(ns, "sim")).get("decode-0")
        return endpoint.epoch if endpoint is not None and endpoint.epoch > epoch_before else None

    epoch_after = await eventually(registered_again, "decode-0 registered again", within=60)
    recovered_s = time.monotonic() - deleted
    async with asyncio.timeout(LOAD_SECONDS + 60):
        out, _ = await traffic.communicate()
    load = Load(**json.loads(out.decode().strip().splitlines()[-1]))

    async def recovery_in_status() -> dict[str, Any] | None:  # written after the registration, not with it
        status = await pdc_status(k8s_api, ns, "sim")
        return status if status.get("recoveries", 0) >= 1 else None

    status = await eventually(recovery_in_status, "the recovery counted in the PDCluster's status", within=30)
    print(
        f"\nfenced {fenced_s * 1000:.0f} ms, stale Mooncake keys gone {cleaned_s * 1000:.0f} ms, "
        f"registered again (epoch {epoch_before} -> {epoch_after}) {recovered_s:.2f} s after the delete; "
        f"operator's lastRecoverySeconds {status.get('lastRecoverySeconds')}; load: {load.ok} ok, "
        f"{load.cut_mid_stream} cut mid-stream, {len(load.failed_before_first_byte)} failed before a byte"
    )
    assert fenced_s < 1.0
    assert cleaned_s < 2.0
    assert epoch_after == epoch_before + 1  # one recreation: the dead incarnation's exit never fails the new pods
    assert load.failed_before_first_byte == []
    assert load.ok > STREAMS
    new_pods = {p.metadata.name: p for p in await pods(k8s_api, ns, "tandem.dev/group=0,tandem.dev/role=decode")}
    assert sorted(new_pods) == ["sim-decode-0-0", "sim-decode-0-1"]
    assert {p.metadata.annotations["tandem.dev/epoch"] for p in new_pods.values()} == {str(epoch_after)}
    after = Load()
    await eventually(lambda: _served(sdk, after), "traffic after the recovery", within=30)


async def _served(sdk: openai.AsyncOpenAI, load: Load) -> bool:
    await stream_once(sdk, load, 1)
    return load.ok > 0
