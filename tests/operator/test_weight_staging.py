"""Weights staged per node (issue #35 item 1): a completion marker instead of "config.json exists", a pinned
revision and a hostPath of type Directory on the nodes labelled as holding the weight disk; the nodes a prefetch
finished on labelled and preferred. Pure, plus the prefetch init container's script run against a stub
``huggingface_hub`` and one reconcile pass against a fake Kube."""

from __future__ import annotations

import re
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest
from pydantic import ValidationError

from tandem.registry import Role
from tandem_operator.act.k8s.apply import object_path
from tandem_operator.api.pdcluster import PDClusterSpec
from tandem_operator.decide.observe import slim_pod
from tandem_operator.decide.staging import node_staged_labels, staging
from tandem_operator.desired.naming import ClusterRef, OwnerRef, canonical_pod, staged_label
from tandem_operator.desired.pods import RoleContext, group_pod
from tandem_operator.desired.recipe import PREFETCH_MARKER
from tandem_operator.run.runtime import ClusterRuntime, RuntimeOptions
from tests.operator.conftest import kimi_spec
from tests.operator.fakes import FakeKube, FakeRegistrar, with_pools
from tests.operator.workers import CLUSTER, live_pod

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
    assert "requiredDuringSchedulingIgnoredDuringExecution" not in before["spec"]["affinity"]["nodeAffinity"]


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


# -- nodes a prefetch finished on are labelled, and pods prefer them ------------------------------------------------

NAME = r"[A-Za-z0-9]([-A-Za-z0-9_.]*[A-Za-z0-9])?"
LABEL_KEY = re.compile(rf"^[a-z0-9]([-a-z0-9]*[a-z0-9])?(\.[a-z0-9]([-a-z0-9]*[a-z0-9])?)*/{NAME}$")


def staged_spec(**changes: Any) -> PDClusterSpec:
    return kimi_spec(transfer={"protocol": "tcp"}, model={**model(nodeLabel=DISK), "revision": SHA, **changes})


def test_one_valid_label_per_staged_copy() -> None:
    label = staged_label(staged_spec())
    assert label is not None
    assert label.startswith("weights.tandem.dev/")
    assert LABEL_KEY.match(label)
    assert len(label.split("/")[1]) <= 63
    others = {
        staged_label(staged_spec(revision="f" * 40)),  # another revision
        staged_label(staged_spec(weightCache={"hostPath": "/mnt/other", "repo": "moonshotai/Kimi-K2.6"})),
        staged_label(staged_spec(weightCache={"hostPath": "/mnt/nvme/models", "repo": "x/" + "y" * 200})),
    }
    assert label not in others
    assert len(others) == 3
    assert all(LABEL_KEY.match(str(o)) for o in others)
    assert staged_label(staged_spec(weightCache={**model()["weightCache"], "prefetch": False})) is None
    assert staged_label(kimi_spec(transfer={"protocol": "tcp"})) is None


def test_pods_prefer_staged_nodes_without_rolling() -> None:
    spec = staged_spec()
    affinity = decode_pod(spec)["spec"]["affinity"]["nodeAffinity"]
    preference = {"matchExpressions": [{"key": staged_label(spec), "operator": "In", "values": ["staged"]}]}
    assert affinity["preferredDuringSchedulingIgnoredDuringExecution"] == [{"weight": 100, "preference": preference}]
    required = {"nodeSelectorTerms": [{"matchExpressions": [{"key": DISK, "operator": "Exists"}]}]}
    assert affinity["requiredDuringSchedulingIgnoredDuringExecution"] == required  # unchanged
    # a preference ranks nodes for new pods only: the pods' revision is the one rendered without it
    assert canonical_pod(decode_pod(spec))["spec"]["affinity"]["nodeAffinity"] == {
        "requiredDuringSchedulingIgnoredDuringExecution": required
    }


def _pod(name: str, node: str, exit_code: int | None) -> dict[str, Any]:
    pod = decode_pod(staged_spec())
    pod["metadata"]["name"], pod["spec"]["nodeName"] = name, node
    state = {"running": {}} if exit_code is None else {"terminated": {"exitCode": exit_code, "finishedAt": "x"}}
    pod["status"] = {"initContainerStatuses": [{"name": "prefetch-weights", "state": state}]}
    return slim_pod(pod)


def test_nodes_a_prefetch_finished_on_are_labelled_and_counted() -> None:
    spec = staged_spec()
    label = staged_label(spec)
    assert label is not None
    pods = [_pod("a", "n1", 0), _pod("b", "n2", None), _pod("c", "n3", 1), _pod("d", "n4", 0), _pod("e", "", 0)]
    other = "weights.tandem.dev/0000"
    node = {"metadata": {"name": "n4", "labels": {label: "staged", other: "staged", "x.io/y": "staged"}}}
    assert node_staged_labels(node) == {label, other}
    labels = {"n1": frozenset({other}), "n4": node_staged_labels(node), "n5": frozenset({label})}
    plan = staging(spec, pods, labels)
    assert plan is not None
    assert plan.to_label == {"n1"}  # n2 still downloading, n3 failed, n4 labelled already
    assert plan.status.to_wire() == {"revision": f"moonshotai/Kimi-K2.6@{SHA}", "nodeLabel": label, "stagedNodes": 2}
    assert staging(kimi_spec(transfer={"protocol": "tcp"}), pods, labels) is None


async def test_the_reconcile_labels_the_node_and_reports_it_in_the_status() -> None:
    spec = staged_spec()
    kube, registrar = FakeKube(), FakeRegistrar()
    runtime = ClusterRuntime(CLUSTER, spec, kube, registrar, RuntimeOptions("test"), dict)
    with_pools(kube, CLUSTER, spec)
    pod = live_pod(spec, Role.DECODE, 0, 0, node="gpu-7")
    pod["status"]["initContainerStatuses"] = [{"name": "prefetch-weights", "state": {"terminated": {"exitCode": 0}}}]
    kube.objects[object_path(pod)] = pod
    await runtime.reconciler.reconcile_once()
    label = staged_label(spec)
    assert [c for c in kube.verbs("patch") if "/nodes/" in c[1]] == [
        ("patch", "/api/v1/nodes/gpu-7", {"metadata": {"labels": {label: "staged"}}})
    ]
    [status] = [c[2]["status"] for c in kube.verbs("apply") if c[2]["kind"] == "PDCluster"]
    assert status["weights"] == {"revision": f"moonshotai/Kimi-K2.6@{SHA}", "nodeLabel": label, "stagedNodes": 1}
    kube.calls.clear()
    await runtime.reconciler.reconcile_once()
    assert [c for c in kube.verbs("patch") if "/nodes/" in c[1]] == []  # labelled: not patched again
