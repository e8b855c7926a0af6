"""``helm template`` of the chart, offline, for the render tests."""

from __future__ import annotations

import functools
import hashlib
import subprocess
from pathlib import Path
from typing import Any

import yaml

from tandem_dev.devcluster.config import default_bin_dir, require_binaries

ROOT = Path(__file__).resolve().parents[2]
CHART = ROOT / "charts" / "tandem"
VALUES_FILES = sorted((ROOT / "deploy").glob("values-*.yaml"))
NAMESPACE = "serving"


def helm(*args: str) -> subprocess.CompletedProcess[str]:
    """Run the helm of the configured control-plane binaries ($TANDEM_K8S_BIN, else the build cache); a missing
    helm fails the test with the command that builds it (``make k8s-binaries``), never skips it."""
    binary = require_binaries(default_bin_dir())["helm"]
    return subprocess.run([str(binary), *args], capture_output=True, text=True, check=False, timeout=60)


def render(*args: str, release: str = "t") -> list[dict[str, Any]]:
    """The documents ``helm template`` renders (hooks and tests included) with extra ``args`` (-f, --set).

    The chart does not change during a session, so each distinct command (with the contents of its ``-f`` files)
    runs helm once (about 0.5 s of CPU each); every call parses its own fresh documents, which tests may edit."""
    return [doc for doc in yaml.load_all(template(release, *args), Loader=yaml.CSafeLoader) if doc]


def template(release: str, *args: str) -> str:
    """``helm template`` output; fails the test with helm's message when it fails."""
    files = [Path(args[i + 1]) for i, arg in enumerate(args[:-1]) if arg in {"-f", "--values"}]
    return _template(release, args, tuple(hashlib.sha256(f.read_bytes()).hexdigest() for f in files))


@functools.cache
def _template(release: str, args: tuple[str, ...], _values_digests: tuple[str, ...]) -> str:
    result = helm("template", release, str(CHART), "--namespace", NAMESPACE, *args)
    assert result.returncode == 0, result.stderr
    return result.stdout


def pod_templates(docs: list[dict[str, Any]]) -> dict[str, dict[str, Any]]:
    """Every pod the rendered objects make, by ``<kind>/<name>``: workload pod templates, bare Pods, Jobs."""
    pods: dict[str, dict[str, Any]] = {}
    for doc in docs:
        key = f"{doc['kind']}/{doc['metadata']['name']}"
        if doc["kind"] == "Pod":
            pods[key] = doc
        elif doc["kind"] == "CronJob":
            pods[key] = doc["spec"]["jobTemplate"]["spec"]["template"]
        elif "template" in doc.get("spec", {}) and "spec" in doc["spec"]["template"]:
            pods[key] = doc["spec"]["template"]
    return pods
