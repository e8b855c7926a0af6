"""The simulated server loads its weights (``tandem_sim/pd/loader.py``, ``pd/seed.py``): the load phases take the
profile's time, the server answers as SGLang 0.5.23 does meanwhile, a peer pulls real bytes from a serving seed
over the Mooncake transfer engine, and a seed killed mid-pull fails the peer's load as SGLang's would.
Real processes in a loopback-only network namespace."""

from __future__ import annotations

import asyncio
import contextlib
import re
import signal
import time
from pathlib import Path
from typing import Any

import aiohttp
import pytest

from tandem_dev.procs import free_port
from tandem_dev.sim.testing import HOST, SimWorker, start_prefill, start_worker
from tandem_sim.model.profiles import KIMI_LOAD

pytestmark = [pytest.mark.netns, pytest.mark.procs, pytest.mark.timeout(180)]

KIMI = ["--sim-profile", "kimi-k2.6-h200", "--sim-load-phases"]
PEER = ["--load-format", "remote_instance", "--remote-instance-weight-loader-backend", "transfer_engine"]
GREEDY = {"text": "alpha beta gamma delta", "sampling_params": {"max_new_tokens": 12, "temperature": 0}}


def _peer_of(seed: SimWorker) -> list[str]:
    return [
        *PEER,
        "--remote-instance-weight-loader-seed-instance-ip",
        HOST,
        "--remote-instance-weight-loader-seed-instance-service-port",
        str(seed.port),
    ]


def _start_seed(name: str, tmp_path: Path, *extra: str) -> SimWorker:
    flags = ["--remote-instance-weight-loader-start-seed-via-transfer-engine"]
    flags += ["--engine-info-bootstrap-port", str(free_port()), "--sim-weight-mb", "8", *extra]
    return start_worker(name, tmp_path, flags)


async def _get(sess: aiohttp.ClientSession, url: str) -> tuple[int | None, Any]:
    try:
        async with sess.get(url) as resp:
            return resp.status, await resp.read()
    except aiohttp.ClientConnectionError:
        return None, None  # not listening


async def _info(sess: aiohttp.ClientSession, worker: SimWorker) -> dict[str, Any]:
    async with sess.get(f"{worker.url}/server_info") as resp:
        doc: dict[str, Any] = (await resp.json())["tandem_sim"]
        return doc


async def _text(sess: aiohttp.ClientSession, worker: SimWorker) -> str:
    async with sess.post(f"{worker.url}/generate", json=GREEDY) as resp:
        assert resp.status == 200
        return str((await resp.json())["text"])


async def test_load_phases_take_the_profiles_time(tmp_path: Path) -> None:
    """A K2.6 prefill reading its node's copy (``--model-path`` is a directory): init, read, jit at the profile's
    times x the time factor. Meanwhile its HTTP port refuses connections (SGLang starts uvicorn only after every
    scheduler is ready) while the PD bootstrap server already answers (503: no rank registered); then ``Starting``
    (``/health`` and ``/ready`` 503, ``/model_info`` 200) until the warm-up passed."""
    factor = 0.2
    model = tmp_path / "Kimi-K2.6"
    model.mkdir()
    args = [*KIMI, "--sim-time-factor", str(factor), "--model-path", str(model)]
    started = time.monotonic()
    prefill = start_prefill("kimi-prefill", tmp_path, args, wait=False)
    route = f"http://{HOST}:{prefill.bootstrap_port}/route?prefill_dp_rank=-1&prefill_cp_rank=-1"
    route += "&target_tp_rank=-1&target_pp_rank=-1"
    seen: list[tuple[float, int | None, int | None, int | None, int | None]] = []
    async with aiohttp.ClientSession() as sess, contextlib.AsyncExitStack() as stack:
        stack.callback(prefill.proc.stop)
        async with asyncio.timeout(120):
            while True:
                assert prefill.proc.alive(), prefill.proc.log_tail()
                health, _ = await _get(sess, f"{prefill.url}/health")
                ready, _ = await _get(sess, f"{prefill.url}/ready")
                model_info, _ = await _get(sess, f"{prefill.url}/model_info")
                bootstrap, _ = await _get(sess, route)
                # /health tells the three phases apart and they only move forward: a sample whose /health answered
                # the same before and after its reads saw one phase in all of them (else a phase change fell between
                # two reads, which a busy machine makes likely enough to fail the checks below).
                health_after, _ = await _get(sess, f"{prefill.url}/health")
                if health_after == health:
                    seen.append((time.monotonic() - started, health, ready, model_info, bootstrap))
                if health_after == 200:
                    break
                await asyncio.sleep(0.01)
        weights = (await _info(sess, prefill))["weights"]
    modelled = {"init": KIMI_LOAD.init_s, "read": KIMI_LOAD.weight_bytes / (KIMI_LOAD.read_gb_s * 1e9)}
    modelled["jit"] = KIMI_LOAD.jit_s
    assert weights["source"] == "local"
    assert weights["phases_s"] == pytest.approx(modelled)
    for name, seconds in modelled.items():
        assert seconds * factor - 0.01 <= weights["elapsed_s"][name] < seconds * factor + 1.0
    loading = [s for s in seen if s[1] is None]
    assert loading
    assert all(s[2] is None and s[3] is None for s in loading)
    assert any(s[4] == 503 for s in loading)  # the PD bootstrap server listens during the load
    first_answer = next(s for s in seen if s[1] is not None)
    assert first_answer[0] >= sum(modelled.values()) * factor
    starting = [s for s in seen if s[1] == 503]
    assert starting
    assert all(s[2] == 503 and s[3] == 200 for s in starting)


async def test_peer_pulls_weights_from_a_serving_seed(tmp_path: Path) -> None:
    """A K2.6 instance with ``--load-format remote_instance`` pulls its weights from a seed through the real
    transfer engine: the bytes it computes with are the seed's (same digest, the seed's ``--sim-seed``, the same
    greedy text) while the seed keeps answering requests; a peer-loaded instance never publishes its weights."""
    seed = _start_seed("seed", tmp_path, "--sim-seed", "7")
    peer_bootstrap = free_port()
    extra = [*KIMI, "--sim-time-factor", "0.2", "--sim-weight-mb", "8", *_peer_of(seed)]
    extra += ["--remote-instance-weight-loader-start-seed-via-transfer-engine"]
    extra += ["--engine-info-bootstrap-port", str(peer_bootstrap)]
    async with aiohttp.ClientSession() as sess, contextlib.AsyncExitStack() as stack:
        stack.callback(seed.proc.stop)
        seed_text = await _text(sess, seed)
        peer = start_worker("peer", tmp_path, extra, wait=False)
        stack.callback(peer.proc.stop)
        served = 0
        async with asyncio.timeout(120):
            while (await _get(sess, f"{peer.url}/health"))[0] != 200:
                assert peer.proc.alive(), peer.proc.log_tail()
                assert await _text(sess, seed) == seed_text  # the seed serves while the peer pulls
                served += 1
        assert served > 0
        seed_info, peer_info = await _info(sess, seed), await _info(sess, peer)
        assert peer_info["weights"]["source"] == "peer"
        assert peer_info["weights"]["digests"] == seed_info["weights"]["digests"]
        assert peer_info["seed"] == 7  # the pulled weights decide the model
        assert await _text(sess, peer) == seed_text
        status, body = await _get(sess, f"{peer.url}/remote_instance_transfer_engine_info?rank=0")
        assert status == 400
        assert b"Failed to get transfer engine info for rank 0" in body
        status, _ = await _get(sess, f"{seed.url}/remote_instance_transfer_engine_info?rank=0")
        assert status == 200
        assert "deprecated" in seed.proc.log_path.read_text()  # the peer asked the seed's HTTP server


def _transport_port(log: str) -> int:
    """The seed's Mooncake TCP transport port, from the engine's own start-up line."""
    found = re.search(r"TcpTransport: listen on port (\d+)", log)
    assert found, log[-2000:]
    return int(found.group(1))


def _connected_to(port: int) -> bool:
    """A socket of this network namespace, in any state (TIME_WAIT included), has ``port`` as its remote end: the peer
    has begun reading from the seed's transport (each read may open and close its own connection)."""
    for table in ("/proc/net/tcp", "/proc/net/tcp6"):
        with contextlib.suppress(FileNotFoundError), open(table) as f:
            for line in f.readlines()[1:]:
                if int(line.split()[2].rsplit(":", 1)[1], 16) == port:
                    return True
    return False


async def test_killed_seed_fails_the_load(tmp_path: Path) -> None:
    """The seed dies while the peer pulls: the next read fails, the scheduler raises SGLang's error and the server
    exits 1 (no retry, no fallback). The kill waits until the peer has read from the seed's transport: killed while
    the peer still asks for the weight info, the peer fails earlier ("Cannot get transfer engine session or weight
    info.", tested in ``test_load_fails_without_a_seed``)."""
    seed = _start_seed("seed", tmp_path)
    transport = _transport_port(seed.proc.log_path.read_text())
    extra = [*KIMI, "--sim-time-factor", "0.5", "--sim-weight-mb", "8", *_peer_of(seed)]
    peer = start_worker("peer", tmp_path, extra, wait=False)
    try:
        async with asyncio.timeout(120):
            while not _connected_to(transport):  # the peer got the weight info and reads
                assert peer.proc.alive(), peer.proc.log_tail()
                await asyncio.sleep(0.005)
        seed.proc.signal(signal.SIGKILL)
        assert peer.proc.popen is not None
        await asyncio.to_thread(peer.proc.popen.wait, 60)
        log = peer.proc.log_path.read_text()
        assert peer.proc.returncode() == 1
        assert "batch transfer failed, error: -1" in log
        assert "Scheduler hit an exception: RuntimeError: Failed to load weights from remote instance" in log
    finally:
        peer.proc.stop()
        seed.proc.stop()


async def test_load_fails_without_a_seed(tmp_path: Path) -> None:
    """No seed at the given address, or a seed port already taken: SGLang's errors, exit 1."""
    port = free_port()
    peer = start_worker(
        "peer",
        tmp_path,
        [
            *PEER,
            "--remote-instance-weight-loader-seed-instance-ip",
            HOST,
            "--remote-instance-weight-loader-seed-instance-service-port",
            str(port),
        ],
        wait=False,
    )
    assert peer.proc.popen is not None
    assert peer.proc.popen.wait(timeout=60) == 1
    assert "Cannot get transfer engine session or weight info." in peer.proc.log_path.read_text()
    seed = _start_seed("seed", tmp_path)
    bootstrap_port = seed.proc.argv[list(seed.proc.argv).index("--engine-info-bootstrap-port") + 1]
    try:
        flags = ["--remote-instance-weight-loader-start-seed-via-transfer-engine"]
        second = start_worker("seed2", tmp_path, [*flags, "--engine-info-bootstrap-port", bootstrap_port], wait=False)
        assert second.proc.popen is not None
        assert second.proc.popen.wait(timeout=60) == 1
        assert f"engine_info_bootstrap_port {bootstrap_port} is already in use" in second.proc.log_path.read_text()
    finally:
        seed.proc.stop()
