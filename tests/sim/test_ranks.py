"""SGLang's process model end to end: multi-rank PD pairs (single- and multi-node), per-rank Mooncake sessions and
bootstrap rows, and the start-up failures of a rank (port range, group). Real processes in a loopback-only netns.

Pairs (the reference is an aggregated ``--tp-size 1`` worker; the KV rows, hence the text, do not depend on TP):

* MHA, 8 KV heads: prefill ``--tp-size 4`` over 2 nodes -> decode ``--tp-size 2`` (each decode rank pulls a head
  slice from two prefill ranks, ``send_kvcache_slice``);
* MLA (the default, like Kimi): prefill ``--tp-size 2`` -> decode ``--tp-size 4`` over 2 nodes (each prefill rank
  waits for two decode ranks' hand-overs and writes the whole latent row into both).
"""

from __future__ import annotations

import random
import socket
import subprocess
import sys
from collections.abc import AsyncIterator, Iterator
from pathlib import Path
from typing import Any

import aiohttp
import pytest

from tandem_dev.procs import ManagedProcess, free_port
from tandem_dev.sim.testing import HOST, SimWorker, pd_fields, start_decode, start_worker
from tandem_sim.pd.mooncake_ports import RDMA_NO_PORT
from tandem_sim.pd.transfer import INIT_FAILED
from tests.plumbing.simhelpers import pd_generate, prompts, start_group

pytestmark = [pytest.mark.netns, pytest.mark.timeout(300)]


def _prefill_args(*extra: str) -> list[str]:
    bootstrap = str(free_port())
    return ["--disaggregation-mode", "prefill", "--disaggregation-bootstrap-port", bootstrap, *extra]


# PD texts are compared with the reference: batch-invariant kernels, as a user wanting that runs SGLang.
DETERMINISTIC = "--enable-deterministic-inference"


@pytest.fixture(scope="module")
def servers(tmp_path_factory: pytest.TempPathFactory) -> Iterator[dict[str, SimWorker]]:
    log_dir = tmp_path_factory.mktemp("sim-ranks")
    procs: list[SimWorker] = []
    try:
        reference = start_worker("reference", log_dir, [DETERMINISTIC])
        procs.append(reference)
        mha_prefill = start_group(
            "mha-prefill", log_dir, 2, _prefill_args("--tp-size", "4", "--sim-kv-heads", "8", DETERMINISTIC)
        )
        procs += mha_prefill
        mha_decode = start_decode("mha-decode", log_dir, ["--tp-size", "2", "--sim-kv-heads", "8", DETERMINISTIC])
        procs.append(mha_decode)
        mla_prefill = start_worker("mla-prefill", log_dir, _prefill_args("--tp-size", "2", DETERMINISTIC))
        procs.append(mla_prefill)
        mla_decode = start_group(
            "mla-decode", log_dir, 2, ["--disaggregation-mode", "decode", "--tp-size", "4", DETERMINISTIC]
        )
        procs += mla_decode
        yield {
            "reference": reference,
            "mha-prefill": mha_prefill[0],
            "mha-decode": mha_decode,
            "mla-prefill": mla_prefill,
            "mla-decode": mla_decode[0],
        }
    finally:
        for worker in procs:
            worker.proc.stop()


@pytest.fixture
async def sess() -> AsyncIterator[aiohttp.ClientSession]:
    async with aiohttp.ClientSession() as session:
        yield session


async def _get(sess: aiohttp.ClientSession, url: str, **params: str) -> Any:
    async with sess.get(url, params=params) as resp:
        assert resp.status == 200, await resp.text()
        return await resp.json()


@pytest.mark.parametrize("kind", ["mha", "mla"])
async def test_multi_rank_pd_equals_aggregated(
    servers: dict[str, SimWorker], sess: aiohttp.ClientSession, kind: str
) -> None:
    rng = random.Random(3)
    for body in prompts(6, seed=21):
        body["sampling_params"]["temperature"] = 0.0
        async with sess.post(f"{servers['reference'].url}/generate", json=body) as resp:
            want = (await resp.json())["text"]
        status, got, p_status = await pd_generate(
            sess, servers[f"{kind}-prefill"], servers[f"{kind}-decode"], body, rng.randrange(2**63)
        )
        assert (status, p_status) == (200, 200), got
        assert got["text"] == want


async def test_every_rank_registers_its_own_bootstrap_row(
    servers: dict[str, SimWorker], sess: aiohttp.ClientSession
) -> None:
    """4 prefill ranks over 2 nodes: 4 rows keyed by TP rank, each rank with its own port."""
    prefill = servers["mha-prefill"]
    base = f"http://{HOST}:{prefill.bootstrap_port}/route"
    info = await _get(sess, base, prefill_dp_rank="-1", prefill_cp_rank="-1", target_tp_rank="-1", target_pp_rank="-1")
    assert (info["attn_tp_size"], info["dp_size"]) == (4, 1)
    rows = [
        await _get(sess, base, prefill_dp_rank="0", prefill_cp_rank="0", target_tp_rank=str(t), target_pp_rank="0")
        for t in range(4)
    ]
    assert len({(r["rank_ip"], r["rank_port"]) for r in rows}) == 4
    async with sess.get(
        base, params={"prefill_dp_rank": "0", "prefill_cp_rank": "0", "target_tp_rank": "4", "target_pp_rank": "0"}
    ) as resp:
        assert resp.status == 404


async def test_per_rank_sessions_are_distinct_and_mapped_as_sglang(
    servers: dict[str, SimWorker], sess: aiohttp.ClientSession
) -> None:
    """Every rank has its own Mooncake session ``ip:port``; each prefill rank knows the decode ranks mapped to it."""
    for kind in ("mha", "mla"):  # make sure both pairs have served a request
        body = dict(prompts(1, seed=2)[0])
        await pd_generate(sess, servers[f"{kind}-prefill"], servers[f"{kind}-decode"], body, 7)
    mha_decode = (await _get(sess, f"{servers['mha-decode'].url}/server_info"))["internal_states"]
    assert [s["tp_rank"] for s in mha_decode] == [0, 1]
    assert [s["prefill_tp_ranks"] for s in mha_decode] == [[0, 1], [2, 3]]  # decode TP 2 <- prefill TP 4
    decode_sessions = [s["session_id"] for s in mha_decode]
    assert len(set(decode_sessions)) == 2
    mha_prefill = (await _get(sess, f"{servers['mha-prefill'].url}/server_info"))["internal_states"]
    assert [s["tp_rank"] for s in mha_prefill] == [0, 1]  # node 0 runs TP ranks 0 and 1 of 4
    assert [s["registered_decode_sessions"] for s in mha_prefill] == [[decode_sessions[0]]] * 2
    mla_prefill = (await _get(sess, f"{servers['mla-prefill'].url}/server_info"))["internal_states"]
    registered = [set(s["registered_decode_sessions"]) for s in mla_prefill]
    assert [len(r) for r in registered] == [2, 2]  # decode TP 4 -> prefill TP 2: two decode ranks per prefill rank
    mla_decode = (await _get(sess, f"{servers['mla-decode'].url}/server_info"))["internal_states"]
    node0 = {s["session_id"] for s in mla_decode}
    assert node0 <= registered[0]  # decode TP ranks 0, 1 run on node 0 and pull from prefill rank 0
    assert not registered[0] & registered[1]  # TP ranks 2, 3 (node 1) have sessions of their own
    all_sessions = [s["session_id"] for s in mla_prefill] + [s["session_id"] for s in mha_prefill]
    all_sessions += decode_sessions + sorted(registered[0] | registered[1])
    assert len(set(all_sessions)) == len(all_sessions)


def _start_fails(tmp_path: Path, name: str, extra: list[str], env: dict[str, str]) -> tuple[int | None, str]:
    worker = start_worker(name, tmp_path, ["--disaggregation-mode", "decode", *extra], env, wait=False)
    assert worker.proc.popen is not None
    try:
        code = worker.proc.popen.wait(timeout=60)
    finally:
        worker.proc.stop()
    return code, worker.proc.log_tail(400)


def _port_base() -> int:
    """A port below the ephemeral ports (Mooncake's valid range), outside its default range, with the 7 after it
    free."""
    rng = random.Random()
    while True:
        base = rng.randrange(20000, 32000)
        if all(_bindable(p) for p in range(base, base + 8)):
            return base


def _bindable(port: int) -> bool:
    with socket.socket() as sock:
        try:
            sock.bind((HOST, port))
        except OSError:
            return False
    return True


@pytest.mark.parametrize(("protocol", "ports_given"), [("tcp", 7), ("rdma", 3)])
def test_a_port_range_too_small_for_every_rank_fails_start_up(tmp_path: Path, protocol: str, ports_given: int) -> None:
    """4 ranks need 8 ports over TCP (RPC + data port each) and 4 over RDMA; one short and start-up fails."""
    base = _port_base()
    env = {"MC_MIN_RPC_PORT": str(base), "MC_MAX_RPC_PORT": str(base + ports_given - 1)}
    env.update({"MC_FORCE_TCP": "1"} if protocol == "tcp" else {"MOONCAKE_PROTOCOL": "rdma"})
    code, log = _start_fails(tmp_path, f"short-{protocol}", ["--tp-size", "4"], env)
    assert code == 1, log
    assert f"Scheduler hit an exception: TransferEngineError: {INIT_FAILED}" in log
    assert "scheduler died during initialization" in log
    if protocol == "rdma":
        assert RDMA_NO_PORT in log


@pytest.mark.parametrize(("protocol", "ports_given"), [("tcp", 8), ("rdma", 4)])
async def test_a_port_range_of_the_right_size_starts_every_rank(
    tmp_path: Path, proc_factory: list[ManagedProcess], protocol: str, ports_given: int
) -> None:
    base = _port_base()
    env = {"MC_MIN_RPC_PORT": str(base), "MC_MAX_RPC_PORT": str(base + ports_given - 1)}
    env.update({"MC_FORCE_TCP": "1"} if protocol == "tcp" else {"MOONCAKE_PROTOCOL": "rdma"})
    worker = start_decode(f"fits-{protocol}", tmp_path, ["--tp-size", "4"], env)
    proc_factory.append(worker.proc)
    async with aiohttp.ClientSession() as sess:
        states = (await _get(sess, f"{worker.url}/server_info"))["internal_states"]
    ports = {int(s["session_id"].rsplit(":", 1)[1]) for s in states}
    assert len(ports) == 4
    if protocol == "tcp":  # RDMA's stand-in engines take their TCP data ports above the range (see mooncake_ports)
        assert all(base <= p < base + ports_given for p in ports)


def test_a_node_that_cannot_reach_dist_init_addr_fails_start_up(tmp_path: Path) -> None:
    dead = f"{HOST}:{free_port()}"
    group = ["--tp-size", "2", "--nnodes", "2", "--node-rank", "1", "--dist-init-addr", dead, "--dist-timeout", "2"]
    code, log = _start_fails(tmp_path, "orphan", group, {})
    assert code == 1, log
    assert f"The client socket has timed out after 2000ms while trying to connect to ({dead.replace(':', ', ')})" in log


@pytest.mark.parametrize(
    ("flags", "message"),
    [
        (["--tp-size", "3", "--nnodes", "2", "--dist-init-addr", "127.0.0.1:1"], "tp_size must be divisible by number"),
        (["--tp-size", "4", "--dp-size", "2", "--attn-dp-size", "2"], "data-parallel replicas combined with attention"),
    ],
)
def test_flags_sglang_refuses_exit_2_with_its_message(flags: list[str], message: str) -> None:
    proc = subprocess.run(
        [sys.executable, "-m", "tandem.cli", "sim", "--model-path", "m", *flags],
        capture_output=True,
        text=True,
        timeout=60,
        check=False,
    )
    assert proc.returncode == 2
    assert message in proc.stderr


async def test_a_page_size_mismatch_kills_the_decode_as_sglang_does(tmp_path: Path) -> None:
    """``try_ensure_parallel_info`` raises in the decode scheduler's loop: SGLang's decode server dies."""
    prefill = start_worker("ps-prefill", tmp_path, _prefill_args())
    decode = start_decode("ps-decode", tmp_path, ["--page-size", "4"])
    try:
        body = dict(prompts(1)[0], **pd_fields(prefill, 5))  # the decode side alone: it reads the prefill's layout
        async with aiohttp.ClientSession() as sess, sess.post(f"{decode.url}/generate", json=body) as resp:
            status, body = resp.status, await resp.json()
        assert status == 500
        assert "Page size mismatch: prefill server has page_size=1, but decode server has page_size=4" in str(body)
        assert decode.proc.popen is not None
        assert decode.proc.popen.wait(timeout=30) == 1
        assert "Scheduler hit an exception: RuntimeError: Page size mismatch" in decode.proc.log_tail(100)
    finally:
        prefill.proc.stop()
        decode.proc.stop()
