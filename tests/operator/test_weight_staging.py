"""Weights staged per node (issue #35 item 1): a completion marker instead of "config.json exists", a pinned
revision and a hostPath of type Directory on the nodes labelled as holding the weight disk. Pure, plus the prefetch
init container's script run against a stub ``huggingface_hub``."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest
from pydantic import ValidationError

from tandem.registry import Role
from tandem_operator.desired.naming import ClusterRef, OwnerRef
from tandem_operator.desired.pods import RoleContext, group_pod
from tandem_operator.desired.recipe import PREFETCH_MARKER
from tests.operator.conftest import kimi_spec

SHA = "0123456789abcdef0123456789abcdef01234567"
DISK = "example.com/weight-disk"


def model(**cache: Any) -> dict[str, Any]:
    return {
        "path": "/models/Kimi-K2.6",
        "weightCache": {"hostPath": "/mnt/nvme/models", "repo": "moonshotai/Kimi-K2.6", **cache},
    }


def decode_pod(spec: Any) -> dict[str, Any]:
    owner = OwnerRef("tandem.dev/v1alpha1", "PDPool", "c-decode", "uid")
    return group_pod(RoleContext.build(ClusterRef("c", "ns", "uid"), spec, Role.DECODE, owner), 0, 0)


@pytest.mark.parametrize("revision", [None, "main", "v1.0", SHA.upper(), SHA[:12]])
def test_staging_from_the_hub_needs_a_pinned_revision(revision: str | None) -> None:
    body = {**model(nodeLabel=DISK), **({"revision": revision} if revision else {})}
    with pytest.raises(ValidationError, match=r"model\.revision must pin a commit"):
        kimi_spec(model=body)


def test_a_pinned_revision_a_copy_not_downloaded_or_no_label_pass() -> None:
    kimi_spec(model={**model(nodeLabel=DISK), "revision": SHA})
    kimi_spec(model=model(nodeLabel=DISK, prefetch=False))  # staged by something else
    kimi_spec(model=model())  # as before: any node, created when missing


def test_the_weight_disk_nodes_are_required_and_the_directory_must_exist() -> None:
    pod = decode_pod(kimi_spec(model={**model(nodeLabel=DISK), "revision": SHA}))
    (volume,) = [v for v in pod["spec"]["volumes"] if v["name"] == "weights"]
    assert volume["hostPath"] == {"path": "/mnt/nvme/models", "type": "Directory"}
    required = pod["spec"]["affinity"]["nodeAffinity"]["requiredDuringSchedulingIgnoredDuringExecution"]
    assert required == {"nodeSelectorTerms": [{"matchExpressions": [{"key": DISK, "operator": "Exists"}]}]}

    before = decode_pod(kimi_spec(model=model()))
    (volume,) = [v for v in before["spec"]["volumes"] if v["name"] == "weights"]
    assert volume["hostPath"]["type"] == "DirectoryOrCreate"
    assert "nodeAffinity" not in before["spec"]["affinity"]


def test_both_node_affinities_together() -> None:
    spec = kimi_spec(model={**model(nodeLabel=DISK), "revision": SHA, "cachedNodeLabel": "example.com/k26"})
    node = decode_pod(spec)["spec"]["affinity"]["nodeAffinity"]
    assert set(node) == {
        "requiredDuringSchedulingIgnoredDuringExecution",
        "preferredDuringSchedulingIgnoredDuringExecution",
    }


STUB = """
import os, sys
def snapshot_download(repo, local_dir, revision=None):
    os.makedirs(local_dir, exist_ok=True)
    with open(os.path.join(local_dir, "calls"), "a") as f:
        f.write(f"{repo}@{revision}\\n")
    open(os.path.join(local_dir, "config.json"), "w").close()  # early, as a real download writes it
    if os.environ.get("FAIL"):
        sys.exit("interrupted")
"""


def run_prefetch(tmp_path: Path, target: Path, revision: str | None, fail: bool = False) -> int:
    body = {**model(), "path": str(target), "mountPath": str(target.parent)}
    spec = kimi_spec(model={**body, **({"revision": revision} if revision else {})})
    (init,) = decode_pod(spec)["spec"]["initContainers"]
    stub = tmp_path / "stub"
    (stub / "huggingface_hub").mkdir(parents=True, exist_ok=True)
    (stub / "huggingface_hub" / "__init__.py").write_text(STUB)
    env = {"PYTHONPATH": str(stub), **({"FAIL": "1"} if fail else {})}
    command = [sys.executable if c == "python3" else c for c in init["command"]]
    return subprocess.run(command, env=env, capture_output=True, timeout=30).returncode


def test_the_prefetch_resumes_an_interrupted_download_and_skips_a_complete_one(tmp_path: Path) -> None:
    target = tmp_path / "models" / "Kimi-K2.6"
    calls = target / "calls"
    assert run_prefetch(tmp_path, target, SHA, fail=True) != 0  # interrupted after config.json
    assert (target / "config.json").exists()
    assert not (target / PREFETCH_MARKER).exists()
    assert run_prefetch(tmp_path, target, SHA) == 0  # config.json alone is no complete copy: downloaded again
    assert (target / PREFETCH_MARKER).read_text() == f"moonshotai/Kimi-K2.6@{SHA}\n"
    assert run_prefetch(tmp_path, target, SHA) == 0  # complete: skipped
    assert calls.read_text().splitlines() == [f"moonshotai/Kimi-K2.6@{SHA}"] * 2
    other = "f" * 40
    assert run_prefetch(tmp_path, target, other) == 0  # another revision is fetched
    assert calls.read_text().splitlines()[-1] == f"moonshotai/Kimi-K2.6@{other}"
    assert (target / PREFETCH_MARKER).read_text() == f"moonshotai/Kimi-K2.6@{other}\n"
