"""SGLang 0.5.23's real argument parser checks every SGLang command line Tandem generates.

The command lines: the operator's golden pod manifests, every PDCluster example in ``deploy/`` (what the chart's
README tells users to apply) rendered by the operator's desired-state code (``group_manifests``: every pod of a
group of each role), and the spec variants of tests/operator/test_sglang_args.py. They all go through
``prepare_server_args`` from the pinned ``sglang==0.5.23`` wheel in the ``sglang-parser`` peer venv
(``make peers``; tandem_dev.peers), in one subprocess.
What that does and does not check: tests/conformance/sglang_parse.py.
"""

from __future__ import annotations

import json
import os
import re
import subprocess
from pathlib import Path
from typing import Any

import pytest
import yaml

from tandem.registry import Role
from tandem_dev import peers
from tandem_operator.api.pdcluster import PDClusterSpec
from tandem_operator.desired.args import LAUNCH
from tandem_operator.desired.naming import ClusterRef, OwnerRef
from tandem_operator.desired.pods import RoleContext, group_manifests
from tandem_sim.config import parse as sim_parse
from tests.operator.test_sglang_args import SPECS

pytestmark = [pytest.mark.procs, pytest.mark.timeout(300)]  # the peer venv imports torch (10-60 s on a loaded machine)
ROOT = Path(__file__).resolve().parents[2]
PARSE = Path(__file__).with_name("sglang_parse.py")
POD_FIELDS = {"status.podIP": "10.20.0.7", "metadata.name": "kimi-decode-0-0"}  # what the kubelet fills in
BAD = {
    "unknown flag": ["--model-path", "m", "--no-such-flag"],
    "bad choice": ["--model-path", "m", "--disaggregation-mode", "both"],
    "bad int": ["--model-path", "m", "--tp-size", "eight"],
}


def _expand(argv: list[str], env: list[dict[str, Any]]) -> list[str]:
    """``$(VAR)`` as the kubelet expands it from the container's env (literal values and downward API fields)."""
    values = {
        e["name"]: e.get("value") or POD_FIELDS.get(e.get("valueFrom", {}).get("fieldRef", {}).get("fieldPath"))
        for e in env
    }
    return [re.sub(r"\$\((\w+)\)", lambda m: str(values.get(m.group(1)) or m.group(0)), arg) for arg in argv]


def pod_lines(prefix: str, manifests: list[dict[str, Any]]) -> dict[str, list[str]]:
    """The SGLang argv of every pod in ``manifests``, ``$(VAR)`` expanded as the kubelet would."""
    lines: dict[str, list[str]] = {}
    for doc in manifests:
        for container in doc["spec"].get("containers", []) if doc["kind"] == "Pod" else []:
            command = [*container.get("command", []), *container.get("args", [])]
            if tuple(command[: len(LAUNCH)]) == LAUNCH:
                lines[f"{prefix}/{doc['metadata']['name']}"] = _expand(command[len(LAUNCH) :], container.get("env", []))
    return lines


def rendered_lines(prefix: str, name: str, spec: PDClusterSpec) -> dict[str, list[str]]:
    """Every pod of group 0 of each role, as the operator's desired-state code renders it."""
    cluster = ClusterRef(name=name, namespace="serving", uid="00000000-0000-0000-0000-000000000001")
    lines: dict[str, list[str]] = {}
    for role in Role:
        owner = OwnerRef("tandem.dev/v1alpha1", "PDPool", f"{name}-{role.value}", f"uid-{role.value}")
        lines |= pod_lines(prefix, group_manifests(RoleContext.build(cluster, spec, role, owner), 0))
    return lines


def all_lines() -> dict[str, list[str]]:
    lines: dict[str, list[str]] = {}
    for path in sorted((ROOT / "tests" / "operator" / "golden").glob("*.yaml")):
        golden = yaml.safe_load(path.read_text())
        if isinstance(golden, list):  # rendered manifests; the upgrade goldens are reports (test_upgrade_golden.py)
            lines |= pod_lines(f"golden/{path.stem}", golden)
    for path in sorted((ROOT / "deploy").glob("*.yaml")):
        doc = yaml.safe_load(path.read_text())
        if doc.get("kind") == "PDCluster":
            spec = PDClusterSpec.model_validate(doc["spec"])
            lines |= rendered_lines(f"deploy/{path.stem}", doc["metadata"]["name"], spec)
    for name, spec in SPECS.items():
        lines |= rendered_lines(f"test_sglang_args/{name}", "kimi", spec)
    return lines


LINES = all_lines()


@pytest.fixture(scope="module")
def parsed() -> dict[str, dict[str, Any]]:
    """Every command line (and the bad ones) through SGLang's own parser, in one subprocess (torch import ~10 s)."""
    python = peers.require("sglang-parser")
    names = [*LINES, *BAD]
    argvs = [*LINES.values(), *BAD.values()]
    done = subprocess.run(
        [str(python), str(PARSE)],
        input=json.dumps(argvs),
        capture_output=True,
        text=True,
        timeout=300,
        check=False,
        env={**os.environ, "HF_HUB_OFFLINE": "1", "PYTHONPATH": ""},
    )
    assert done.returncode == 0, done.stderr[-3000:]
    return dict(zip(names, json.loads(done.stdout), strict=True))


def test_every_kind_of_command_line_is_covered() -> None:
    assert any(n.startswith("golden/") for n in LINES)
    assert {n.split("/")[1] for n in LINES if n.startswith("deploy/")} >= {"kimi-k26-h200", "sim-small"}
    assert any(n.endswith("-1") for n in LINES if n.startswith("deploy/"))  # multi-node groups: every node rank


def _flag(argv: list[str], name: str) -> str | None:
    return argv[argv.index(name) + 1] if name in argv else None


@pytest.mark.parametrize("name", LINES)
def test_sglang_accepts_the_generated_command_line(parsed: dict[str, dict[str, Any]], name: str) -> None:
    argv, result = LINES[name], parsed[name]
    assert result["ok"], f"SGLang 0.5.23 refuses {name}: {result['error']}\n{' '.join(argv)}"
    got = result["args"]
    # SGLang read our flags into the fields we meant.
    assert got["model_path"] == _flag(argv, "--model-path")
    assert got["tp_size"] == int(_flag(argv, "--tp-size") or 1)
    assert got["nnodes"] == int(_flag(argv, "--nnodes") or 1)
    assert got["node_rank"] == int(_flag(argv, "--node-rank") or 0)
    assert got["disaggregation_mode"] == _flag(argv, "--disaggregation-mode")
    assert got["dist_init_addr"] == _flag(argv, "--dist-init-addr")


@pytest.mark.parametrize("name", BAD)
def test_sglang_and_the_simulator_refuse_the_same_bad_flags(
    parsed: dict[str, dict[str, Any]], name: str, capsys: pytest.CaptureFixture[str]
) -> None:
    """The check can fail: SGLang refuses these, and ``tandem sim`` exits 2 with the same argparse message."""
    result = parsed[name]
    assert not result["ok"]
    assert result["status"] == 2
    with pytest.raises(SystemExit) as exc:
        sim_parse(BAD[name], env={})
    assert exc.value.code == 2
    sim_message = capsys.readouterr().err.strip().splitlines()[-1].split("error: ", 1)[1]
    assert sim_message == result["error"][-1].split("error: ", 1)[1]
