"""The SGLang flag table: generated from the pinned wheel, accepted by ``tandem sim``, unknown flags rejected."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest

from tandem.sglang_args import load_flags, validate_command
from tandem_dev import peers
from tandem_sim.config import ConfigError, parse

ROOT = Path(__file__).resolve().parents[2]

ISSUE_FLAGS = (
    "--model-path",
    "--served-model-name",
    "--host",
    "--port",
    "--tp-size",
    "--ep-size",
    "--attn-dp-size",
    "--dist-init-addr",
    "--nnodes",
    "--node-rank",
    "--page-size",
    "--max-running-requests",
    "--max-total-tokens",
    "--disaggregation-mode",
    "--disaggregation-transfer-backend",
    "--disaggregation-bootstrap-port",
    "--disaggregation-ib-device",
    "--disaggregation-decode-enable-offload-kvcache",
    "--hicache-storage-backend",
    "--enable-metrics",
    "--tool-call-parser",
    "--reasoning-parser",
    "--trust-remote-code",
)


def test_table_has_every_flag_the_operator_generates() -> None:
    names = {name for flag in load_flags() for name in flag.names}
    assert set(ISSUE_FLAGS) <= names
    assert len(names) > 400


def test_kimi_pd_command_line_validates() -> None:
    argv = [
        "--model-path", "moonshotai/Kimi-K2.6", "--trust-remote-code", "--tool-call-parser", "kimi_k2",
        "--reasoning-parser", "kimi_k2", "--tp-size", "8", "--attn-dp-size", "8", "--ep-size", "8",
        "--moe-a2a-backend", "deepep", "--deepep-mode", "low_latency", "--disaggregation-mode", "decode",
        "--disaggregation-transfer-backend", "mooncake", "--disaggregation-ib-device", "mlx5_0,mlx5_1",
        "--dist-init-addr", "10.0.0.1:5000", "--nnodes", "2", "--node-rank", "1", "--max-total-tokens", "4k",
    ]  # fmt: skip
    assert validate_command(argv) == []


def test_unknown_flag_and_bad_choice_are_errors() -> None:
    assert "unrecognized arguments: --no-such-flag" in validate_command(["--model-path", "m", "--no-such-flag"])[0]
    assert "invalid choice" in validate_command(["--model-path", "m", "--disaggregation-mode", "both"])[0]
    with pytest.raises(SystemExit) as exc:
        parse(["--model-path", "m", "--cuda-graph-bs", "8"], env={})  # not a 0.5.23 flag (per-phase spelling now)
    assert exc.value.code == 2


def test_sim_checks_offload_needs_storage_backend() -> None:
    with pytest.raises(ConfigError, match="--hicache-storage-backend"):
        parse(
            ["--model-path", "m", "--disaggregation-mode", "decode", "--disaggregation-decode-enable-offload-kvcache"],
            env={},
        )
    cfg = parse(
        ["--model-path", "m", "--disaggregation-mode", "decode", "--disaggregation-decode-enable-offload-kvcache",
         "--hicache-storage-backend", "mooncake", "--enable-eplb"],
        env={"SGLANG_DISAGGREGATION_HEARTBEAT_INTERVAL": "0.5", "SGLANG_TEST_DISAGG_FAILURE_PROB": "0.25"},
    )  # fmt: skip
    assert cfg.offload
    assert cfg.server_args["enable_eplb"] is True
    assert cfg.pd.heartbeat_interval_s == 2.0  # SGLang's floor
    assert cfg.transfer_failure_prob == 0.25


@pytest.mark.procs
def test_committed_table_matches_the_wheel() -> None:
    """Never skipped: ``make peers`` (run by ``make test``) fetches the hash-checked wheel; without it this fails
    with that command."""
    peers.require("sglang-wheel")
    result = subprocess.run(
        [sys.executable, str(ROOT / "scripts" / "gen_sglang_flags.py"), "--check"], capture_output=True, text=True
    )
    assert result.returncode == 0, result.stderr
