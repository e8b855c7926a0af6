"""Which pods of the ``deploy/`` examples an upgrade from the previous release would roll, and why.

golden/previous-release.yaml holds the previous release's rendering of every ``deploy/`` PDCluster (written by
``python -m tandem_dev.operator.release_golden <release ref>``); this tree renders the same specs, and the report
(revision per role, and per rank the image, flags, env and other fields that differ) must equal
golden/upgrade-from-previous-release.yaml: a change of rendering shows up there, for review, as the pods it restarts
(``TANDEM_UPDATE_GOLDEN=1`` rewrites the report). Under the default ``upgradePolicy`` (Manual) such pods only get
the ``PodsOutdated`` condition until the user triggers the roll (operator/README.md, "Upgrades").
"""

from __future__ import annotations

import os
from pathlib import Path
from typing import Any

import yaml

from tandem.registry import Role
from tandem_dev.operator.release_golden import GOLDEN, record, upgrade_report
from tandem_operator.api.pdcluster import PDClusterSpec
from tandem_operator.desired.compare import container_view
from tandem_operator.desired.naming import ClusterRef, OwnerRef
from tandem_operator.desired.pods import RoleContext, group_pod, revision_pods

DEPLOY = Path(__file__).resolve().parents[2] / "deploy"
REPORT = GOLDEN.with_name("upgrade-from-previous-release.yaml")


def _examples() -> dict[str, dict[str, Any]]:
    found = {}
    for path in sorted(DEPLOY.glob("*.yaml")):
        for doc in yaml.safe_load_all(path.read_text()):
            if doc and doc.get("kind") == "PDCluster":
                found[path.stem] = doc
    return found


def _rendered(doc: dict[str, Any]) -> dict[str, list[dict[str, Any]]]:
    meta = doc["metadata"]
    ref = ClusterRef(meta["name"], meta.get("namespace", "default"), "uid")
    spec = PDClusterSpec.model_validate(doc["spec"])
    pods = {}
    for role in Role:
        owner = OwnerRef("tandem.dev/v1alpha1", "PDPool", f"{ref.name}-{role.value}", "uid")
        pods[role.value] = revision_pods(RoleContext.build(ref, spec, role, owner))
    return pods


def test_upgrading_from_the_previous_release_rolls_only_the_reported_pods() -> None:
    previous = yaml.safe_load(GOLDEN.read_text())
    examples = _examples()
    assert sorted(examples) == sorted(previous["examples"]), "a deploy/ example is new or gone: regenerate the golden"
    report: dict[str, Any] = {"release": previous["release"], "examples": {}}
    for name, doc in examples.items():
        before = previous["examples"][name]
        entry = upgrade_report(before["roles"], record(_rendered(doc)))
        if doc["spec"] != before["spec"]:
            entry["specChanged"] = True  # the example itself changed since the release: not the operator alone
        report["examples"][name] = entry
    text = yaml.safe_dump(report, sort_keys=False, width=120)
    print(f"\nupgrade from release {previous['release']}:\n{text}")
    if os.environ.get("TANDEM_UPDATE_GOLDEN") == "1":
        REPORT.write_text(text)
    assert REPORT.read_text() == text, f"{REPORT} differs; rerun with TANDEM_UPDATE_GOLDEN=1 and review"


def test_the_revision_ignores_what_differs_by_group_rank_epoch_and_owner() -> None:
    """Two groups, incarnations and PDPool uids of one spec render different names, ports and owners: the revision
    is taken over one canonical group, so it is the same for all of them."""
    doc = _examples()["sim-small"]
    spec = PDClusterSpec.model_validate(doc["spec"])
    ctx = RoleContext.build(ClusterRef("sim", "sim", "a"), spec, Role.DECODE, OwnerRef("v", "PDPool", "p", "a"))
    other = RoleContext.build(ClusterRef("sim", "sim", "b"), spec, Role.DECODE, OwnerRef("v", "PDPool", "p", "b"))
    assert ctx.template_hash == other.template_hash
    group_1 = [group_pod(ctx, 1, rank, epoch=3) for rank in range(spec.decode.nodes_per_group)]
    assert group_1 != revision_pods(ctx)
    assert [container_view(p)["env"]["MC_MIN_RPC_PORT"] for p in group_1] != ["15100", "15100"]  # moved by epoch
