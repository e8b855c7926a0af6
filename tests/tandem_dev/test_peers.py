"""Peers are pinned, looked up without a registry, and a missing one is named with the command that installs it."""

from __future__ import annotations

from importlib import resources
from pathlib import Path

import pytest

from tandem_dev import peers


@pytest.mark.parametrize("name", ["smg", "sglang-parser"])
def test_every_package_of_a_peer_venv_is_pinned(name: str) -> None:
    text = resources.files("tandem_dev").joinpath("data", "peers", f"{name}.txt").read_text()
    lines = [line for line in text.splitlines() if line and not line.startswith("#")]
    assert lines
    assert all("==" in line and ">" not in line and "<" not in line for line in lines), lines


def test_torch_is_the_version_sglang_pins() -> None:
    assert peers.pinned_version("sglang-parser", "torch") == "2.14.1"  # sglang 0.5.23: Requires-Dist torch==2.14.1


@pytest.mark.parametrize("name", ["smg", "sglang-wheel", "sglang-parser"])
def test_missing_peer_names_itself_and_make_peers(name: str, tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(peers, "CACHE", tmp_path)
    monkeypatch.setattr(peers, "WHEELS", tmp_path / "wheels")
    with pytest.raises(peers.PeerMissingError, match=rf"peer {name} \(.*\) is not installed here: run `make peers`"):
        peers.require(name)


def test_a_wheel_with_another_hash_is_not_the_peer(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(peers, "WHEELS", tmp_path)
    (tmp_path / peers.SGLANG_WHEEL).write_bytes(b"not the wheel")
    assert peers.sglang_wheel() is None
