"""The simulator's load model without processes (``tandem_sim/model/weights.py``, ``profiles.LoadProfile``): SGLang's
load-flag resolution, the phases and their times for the K2.6 profile, the default profile's zero load."""

from __future__ import annotations

import pytest

from tandem_sim.config import build_parser
from tandem_sim.model.profiles import KIMI_LOAD, NO_LOAD, PROFILES
from tandem_sim.model.weights import (
    INCOMPLETE,
    INCOMPLETE_NCCL,
    LoadFlagError,
    LoadSettings,
    make_weights,
    param_sizes,
    phases,
    physical_bound_s,
    resolve_load,
    seed_of,
)


def _settings(*argv: str) -> LoadSettings:
    return resolve_load(build_parser().parse_args(["--model-path", "sim/model", *argv]))


PEER = ("--load-format", "remote_instance", "--remote-instance-weight-loader-backend", "transfer_engine")
SEED_AT = ("--remote-instance-weight-loader-seed-instance-ip", "10.0.0.1")
SEED_PORT = ("--remote-instance-weight-loader-seed-instance-service-port", "30000")


def test_remote_instance_resolves_as_sglang() -> None:
    peer = _settings(*PEER, *SEED_AT, *SEED_PORT)
    assert peer.peer
    assert peer.transfer_engine
    assert peer.seed_url == "http://10.0.0.1:30000"
    no_port = _settings(*PEER, *SEED_AT)
    assert not no_port.peer
    assert no_port.warnings == (INCOMPLETE,)
    nccl = _settings("--load-format", "remote_instance", *SEED_AT, *SEED_PORT)  # nccl is SGLang's default backend
    assert not nccl.peer
    assert nccl.warnings == (INCOMPLETE_NCCL,)
    with pytest.raises(LoadFlagError, match="implements transfer_engine"):
        _settings(
            "--load-format",
            "remote_instance",
            *SEED_AT,
            *SEED_PORT,
            "--remote-instance-weight-loader-send-weights-group-ports",
            "[1,2]",
        )
    saver = _settings(*PEER, *SEED_AT, *SEED_PORT, "--enable-memory-saver")
    assert not saver.peer
    assert "not supported" in saver.warnings[-1]
    seed = _settings("--remote-instance-weight-loader-start-seed-via-transfer-engine")
    assert seed.start_seed
    assert seed.transfer_engine
    assert not seed.peer
    assert seed.engine_info_bootstrap_port == 6789


def test_kimi_phases_per_source() -> None:
    """Issue #35's numbers: a recreated K2.6 decode node (TP 8 on one node) serves within 90 s from a peer; from the
    node's copy or the hub it takes the read or the download of the whole checkpoint."""
    decode = ("--disaggregation-mode", "decode")

    def total(*argv: str) -> float:
        return sum(p.seconds for p in phases(KIMI_LOAD, _settings(*argv), 8, 8)) + KIMI_LOAD.server_warmup_s

    peer = total(*decode, *PEER, *SEED_AT, *SEED_PORT)
    download = total(*decode)
    assert peer == pytest.approx(15 + 2 + 600 / 190 + 20 + 12 + 1.5)
    assert peer <= 90
    assert download == pytest.approx(15 + 480 + 50 + 20 + 12 + 1.5)
    bound = physical_bound_s(KIMI_LOAD, _settings(*decode, *PEER, *SEED_AT, *SEED_PORT), 8, 8)
    assert bound == pytest.approx(600 / 190 + 20 + 12)
    prefill = [p.name for p in phases(KIMI_LOAD, _settings("--disaggregation-mode", "prefill"), 8, 8)]
    assert "cuda_graph" not in prefill  # SGLang disables decode CUDA graphs on a prefill server
    # a 2-node group: a peer pulls each node's half, a download still fetches the whole checkpoint per node
    two_nodes = {p.name: p.nbytes for p in phases(KIMI_LOAD, _settings(*PEER, *SEED_AT, *SEED_PORT), 16, 8)}
    assert two_nodes["peer"] == pytest.approx(300e9)


def test_default_profiles_load_in_no_time() -> None:
    """The tests' profiles keep today's start-up: every phase is zero seconds."""
    for name in ("cpu-small", "instant"):
        assert PROFILES[name].load is NO_LOAD
        assert sum(p.seconds for p in phases(NO_LOAD, _settings(), 1, 1)) == 0


def test_weights_carry_their_seed() -> None:
    data = make_weights(7, 3, 1 << 16)
    assert seed_of(data) == 7
    assert (data != make_weights(7, 4, 1 << 16)).any()
    assert sum(param_sizes(1000)) == 1000
