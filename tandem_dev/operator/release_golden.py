"""The previous release's worker pods for the ``deploy/`` examples, and what this tree would change in them.

``python -m tandem_dev.operator.release_golden <git ref of the release>`` (after each release, with its commit)
renders every PDCluster of the release's own ``deploy/*.yaml`` with the release's operator, in a subprocess that
imports that release's code from a ``git archive`` in a temporary directory (the repository is only read), and
writes ``tests/operator/golden/previous-release.yaml``: per example and role, the revision (this tree's
``naming.template_hash`` over the release's pods), the compatibility revision, and per rank the worker container's
image, flags and env and a digest of every other field. tests/operator/test_upgrade_golden.py renders the same
examples with this tree and reports, per role, whether an upgrade from the release rolls its pods and why;
``TANDEM_UPDATE_GOLDEN=1`` rewrites that report (tests/operator/golden/upgrade-from-previous-release.yaml).
"""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
import tempfile
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any

import yaml

from tandem.registry import Role
from tandem_operator.desired.compare import container_view, differences, field_changes, field_digests
from tandem_operator.desired.naming import LABEL_REVISION, canonical_pod, template_hash

ROOT = Path(__file__).resolve().parents[2]
GOLDEN = ROOT / "tests" / "operator" / "golden" / "previous-release.yaml"

# Runs inside the release's tree (cwd): only APIs every release has (RoleContext.build, group_pod).
_RENDER = """
import json, pathlib, sys
import yaml
from tandem.registry import Role
from tandem_operator.api.pdcluster import PDClusterSpec
from tandem_operator.desired.naming import ClusterRef, OwnerRef
from tandem_operator.desired.pods import RoleContext, group_pod
out = {}
for path in sorted(pathlib.Path("deploy").glob("*.yaml")):
    for doc in yaml.safe_load_all(path.read_text()):
        if not doc or doc.get("kind") != "PDCluster":
            continue
        meta = doc["metadata"]
        ref = ClusterRef(meta["name"], meta.get("namespace", "default"), "uid")
        spec = PDClusterSpec.model_validate(doc["spec"])
        pods = {}
        for role in Role:
            owner = OwnerRef("tandem.dev/v1alpha1", "PDPool", f"{ref.name}-{role.value}", "uid")
            ctx = RoleContext.build(ref, spec, role, owner)
            pods[role.value] = [group_pod(ctx, 0, rank) for rank in range(spec.role(role).nodes_per_group)]
        out[path.stem] = {"cluster": {"name": ref.name, "namespace": ref.namespace}, "spec": doc["spec"], "pods": pods}
json.dump(out, sys.stdout)
"""


def render_release(ref: str) -> dict[str, Any]:
    """Every ``deploy/`` example of release ``ref`` as that release renders it (``_RENDER``'s output)."""
    with tempfile.TemporaryDirectory(prefix="tandem-release-") as tmp:
        archive = subprocess.run(["git", "-C", str(ROOT), "archive", ref], check=True, capture_output=True).stdout
        subprocess.run(["tar", "-x", "-C", tmp], input=archive, check=True)
        # The release's packages first; the editable install of this tree would shadow them, so it goes.
        prelude = "import sys; sys.meta_path = [f for f in sys.meta_path if 'Editable' not in type(f).__name__ "
        prelude += "and not getattr(f, '__name__', '').startswith('__editable__')]\n"
        env = {"PYTHONPATH": f"{tmp}/operator:{tmp}", "PATH": "/usr/bin:/bin"}
        found = subprocess.run(
            [sys.executable, "-c", prelude + _RENDER], cwd=tmp, env=env, check=True, capture_output=True, text=True
        )
    rendered: dict[str, Any] = json.loads(found.stdout)
    return rendered


def record(pods: Mapping[str, Sequence[Mapping[str, Any]]]) -> dict[str, Any]:
    """Per role: the revision of its pods, their compatibility revision, and per rank the worker container."""
    roles: dict[str, Any] = {}
    for role in Role:
        members = pods[role.value]
        roles[role.value] = {
            "revision": template_hash(members),
            "compatRevision": members[0]["metadata"]["labels"].get(LABEL_REVISION, ""),
            "pods": [{**container_view(pod), "fields": field_digests(canonical_pod(pod))} for pod in members],
        }
    return roles


def release_golden(ref: str, rendered: Mapping[str, Any]) -> dict[str, Any]:
    examples = {
        name: {"cluster": example["cluster"], "spec": example["spec"], "roles": record(example["pods"])}
        for name, example in sorted(rendered.items())
    }
    return {"release": ref, "examples": examples}


def upgrade_report(previous: Mapping[str, Any], current: Mapping[str, Any]) -> dict[str, Any]:
    """Per role of one example: does the upgrade roll its pods (the revision changes), and what changes per rank
    (image, flags, env, other fields). ``previous`` and ``current`` are ``record`` outputs."""
    report: dict[str, Any] = {}
    for role, now in current.items():
        before = previous[role]
        entry: dict[str, Any] = {"rolls": before["revision"] != now["revision"]}
        if entry["rolls"]:
            entry["revision"] = f"{before['revision']} -> {now['revision']}"
        if before["compatRevision"] != now["compatRevision"]:
            entry["compatRevision"] = f"{before['compatRevision']} -> {now['compatRevision']}"
        if len(before["pods"]) != len(now["pods"]):
            entry["ranks"] = f"{len(before['pods'])} -> {len(now['pods'])}"
        for rank, (old, new) in enumerate(zip(before["pods"], now["pods"], strict=False)):
            changes = differences(old, new) + field_changes(old["fields"], new["fields"])
            if changes:
                entry[f"rank {rank}"] = changes
        report[role] = entry
    return report


def main(argv: Sequence[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("ref", help="git commit or tag of the previous release, e.g. 69d5aeb")
    args = parser.parse_args(argv)
    golden = release_golden(args.ref, render_release(args.ref))
    GOLDEN.write_text(yaml.safe_dump(golden, sort_keys=False, width=120))
    print(f"wrote {GOLDEN.relative_to(ROOT)}: {', '.join(golden['examples'])} as release {args.ref} renders them")


if __name__ == "__main__":
    main()
