"""A K2.6-shaped prefill (8 ranks in one process, HiCache on the Mooncake Store) against the real Store: a real
``mooncake_master`` in HA mode on etcd (as the chart runs it, ``--cluster_id=tandem``) and the simulator opening the
real Store client per rank (``tandem_sim.pd.mooncake_store``), with the env the operator renders for the pod.

- The env the operator rendered before this change (TE metadata in etcd, no local hostname, no Store cluster id,
  a window sized for the PD engines alone) fails at start-up with SGLang's error, as the review found on H200s.
- The Store cluster id missing alone: the client looks for its master under Mooncake's default id and finds none.
- The env the operator renders now serves, and a repeated prompt is read back from the Store (prefix hits counted
  in ``tandem_sim:hicache_storage_hit_tokens_total``).

Over tcp, as the dev cluster runs (the simulator has no RDMA); the rdma recipe reuses the PD engine instead (the
operator's rendering is tested in tests/operator/test_desired.py). ``MC_STORE_CLIENT_SETUP_RETRIES=2`` (Mooncake's
default 20) keeps the failing start-ups short; nothing else differs from the rendered pod.
"""

from __future__ import annotations

import random
import sys
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import aiohttp
import pytest

from tandem.registry import Role
from tandem_dev.local_stack import start_etcd
from tandem_dev.procs import ManagedProcess, free_port
from tandem_dev.sim.testing import start_decode, start_prefill
from tandem_operator.api.pdcluster import PDClusterSpec
from tandem_operator.desired.pods import RoleContext, group_pod
from tests.operator.workers import CLUSTER, POOL
from tests.plumbing.simhelpers import REAL_WORDS, metric_sum, pd_generate

pytestmark = [pytest.mark.procs, pytest.mark.netns, pytest.mark.timeout(240)]

RANKS = 8
PAGE = 64
HOST = "127.0.0.1"


@pytest.fixture(scope="module")
def mooncake(tmp_path_factory: pytest.TempPathFactory) -> Iterator[str]:
    """etcd and a mooncake_master in HA mode on it, as the chart runs it: the etcd endpoint (host:port)."""
    workdir = tmp_path_factory.mktemp("mooncake")
    etcd, endpoint = start_etcd(workdir)
    master = ManagedProcess(
        "mooncake-master",
        [
            str(Path(sys.executable).parent / "mooncake_master"),
            "--enable_ha=true",
            "--ha_backend_type=etcd",
            f"--etcd_endpoints={endpoint}",
            "--cluster_id=tandem",
            f"--rpc_port={free_port()}",
            f"--metrics_port={free_port()}",
            f"--rpc_address={HOST}",
        ],
        workdir / "master.log",
    ).start()
    try:
        yield endpoint
    finally:
        master.stop()
        etcd.stop()


def _spec(etcd: str) -> PDClusterSpec:
    """The K2.6 recipe's prefill (8 ranks, HiCache with the Mooncake Store) over tcp, as on the dev cluster."""
    hicache = {
        "enabled": True,
        "hostMemoryGib": 1,
        "storageBackend": "mooncake",
        "mooncakeStore": {"masterHa": True, "globalSegmentGib": 1},
    }
    return PDClusterSpec.model_validate(
        {
            "transfer": {"protocol": "tcp"},
            "etcd": {"endpoints": [f"http://{etcd}"]},
            "prefill": {"tpSize": RANKS, "gpusPerNode": RANKS, "hicache": hicache},
        }
    )


def rendered_env(etcd: str) -> dict[str, str]:
    """The Mooncake env of the operator's prefill pod, with the pod IP filled in as the kubelet does."""
    pod = group_pod(RoleContext.build(CLUSTER, _spec(etcd), Role.PREFILL, POOL), 0, 0)
    env = {e["name"]: e.get("value", HOST) for e in pod["spec"]["containers"][0]["env"]}
    env = {k: v.replace("$(POD_IP)", HOST) for k, v in env.items() if k.startswith(("MC_", "MOONCAKE_"))}
    return {**env, "MC_STORE_CLIENT_SETUP_RETRIES": "2"}


def before_this_change(etcd: str) -> dict[str, str]:
    """What the operator rendered before: TE metadata in etcd, no hostname, no cluster id, 2 ports a rank."""
    env = {k: v for k, v in rendered_env(etcd).items() if k not in ("MOONCAKE_LOCAL_HOSTNAME", "MC_STORE_CLUSTER_ID")}
    low = int(env["MC_MIN_RPC_PORT"])
    return {**env, "MOONCAKE_TE_META_DATA_SERVER": f"etcd://{etcd}", "MC_MAX_RPC_PORT": str(low + 2 * RANKS - 1)}


def _args(page_size: int = PAGE) -> list[str]:
    # deterministic: an answer read back from the Store is compared with the first (a hit changes the prefill batch)
    return ["--tp-size", str(RANKS), "--page-size", str(page_size), "--enable-metrics", "--sim-inter-token-ms", "1",
            "--enable-deterministic-inference"]  # fmt: skip


def _hicache() -> list[str]:
    return ["--enable-hierarchical-cache", "--hicache-size", "1", "--hicache-storage-backend", "mooncake"]


PORT_ERRORS = ("No valid port", "not valid port", "unable to find available tcp port")


@pytest.mark.parametrize(
    ("case", "cause"),
    [
        ("before this change", ("No master is available",)),
        ("no store cluster id", ("No master is available",)),  # Mooncake's default id: mooncake_cluster
        ("TE metadata in etcd and 2 ports a rank", PORT_ERRORS),  # the master found: the Store's engine has no port
    ],
)
def test_a_prefill_with_a_wrong_store_env_dies_at_start_with_sglangs_error(
    mooncake: str, tmp_path: Path, case: str, cause: tuple[str, ...]
) -> None:
    env = rendered_env(mooncake)
    if case == "no store cluster id":
        del env["MC_STORE_CLUSTER_ID"]
    if case != "no store cluster id":
        env = {
            **before_this_change(mooncake),
            **({} if case == "before this change" else {"MC_STORE_CLUSTER_ID": "tandem"}),
        }
    prefill = start_prefill("prefill", tmp_path, [*_args(), *_hicache()], env=env, wait=False)
    try:
        assert prefill.proc.popen is not None
        code = prefill.proc.popen.wait(180)
        log = prefill.proc.log_tail(200)
        assert code != 0, log
        assert "Failed to setup Mooncake store, error code" in log, log
        assert any(message in log for message in cause), log
    finally:
        prefill.proc.stop()


async def test_the_rendered_env_serves_and_reads_a_repeated_prefix_back_from_the_store(
    mooncake: str, tmp_path: Path
) -> None:
    env = rendered_env(mooncake)
    assert int(env["MC_MAX_RPC_PORT"]) - int(env["MC_MIN_RPC_PORT"]) + 1 == 4 * RANKS  # PD + Store engine, tcp
    prefill = start_prefill("prefill", tmp_path, [*_args(), *_hicache()], env=env, timeout=120)
    decode = start_decode(
        "decode",
        tmp_path,
        _args(),
        env={"MC_FORCE_TCP": "true", "MC_MIN_RPC_PORT": "22000", "MC_MAX_RPC_PORT": "22031"},
    )
    try:
        words = random.Random(32).choices(REAL_WORDS, k=3 * PAGE)
        body: dict[str, Any] = {"text": " ".join(words), "sampling_params": {"max_new_tokens": 8, "temperature": 0}}
        async with aiohttp.ClientSession() as sess:
            first = await pd_generate(sess, prefill, decode, body, 1)
            assert (first[0], first[2]) == (200, 200), first
            assert await metric_sum(prefill.url, "tandem_sim:hicache_storage_hit_tokens_total") == 0
            second = await pd_generate(sess, prefill, decode, body, 2)
            assert (second[0], second[2]) == (200, 200), second
        assert second[1]["text"] == first[1]["text"]  # the pages read back are the prompt's own KV
        assert await metric_sum(prefill.url, "tandem_sim:hicache_storage_hit_tokens_total") >= 2 * PAGE
    finally:
        decode.proc.stop()
        prefill.proc.stop()
