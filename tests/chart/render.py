"""``helm template`` of the chart, offline, for the render tests."""

from __future__ import annotations

import functools
import hashlib
import os
import subprocess
from pathlib import Path
from typing import Any

import yaml

from tandem_dev.devcluster.config import default_bin_dir, require_binaries
from tandem_dev.peers import CACHE

ROOT = Path(__file__).resolve().parents[2]
CHART = ROOT / "charts" / "tandem"
VALUES_FILES = sorted((ROOT / "deploy").glob("values-*.yaml"))
NAMESPACE = "serving"
RENDERS = CACHE / "helm-template"


def helm(*args: str) -> subprocess.CompletedProcess[str]:
    """Run the helm of the configured control-plane binaries ($TANDEM_K8S_BIN, else the build cache); a missing
    helm fails the test with the command that builds it (``make k8s-binaries``), never skips it."""
    binary = require_binaries(default_bin_dir())["helm"]
    return subprocess.run([str(binary), *args], capture_output=True, text=True, check=False, timeout=60)


def render(*args: str, release: str = "t") -> list[dict[str, Any]]:
    """The documents ``helm template`` renders (hooks and tests included) with extra ``args`` (-f, --set).

    Every call parses its own fresh documents, which tests may edit."""
    return [doc for doc in yaml.load_all(template(release, *args), Loader=yaml.CSafeLoader) if doc]


def template(release: str, *args: str) -> str:
    """``helm template`` output; fails the test with helm's message when it fails.

    The output is a function of the chart's files, the helm binary, the command and the ``-f`` files' contents, so
    it is kept under ``~/.cache/tandem/helm-template/`` by a digest of all of them (about 0.5 s of CPU saved per
    command: ``make unit`` runs some 40 distinct ones). Any change to any of them is a new digest and a fresh
    render; a failed render is never kept."""
    files = [Path(args[i + 1]) for i, arg in enumerate(args[:-1]) if arg in {"-f", "--values"}]
    digest = hashlib.sha256("\0".join([_chart_and_helm_digest(), release, *args]).encode())
    for file in files:
        digest.update(file.read_bytes())
    return _template(release, args, digest.hexdigest())


@functools.cache
def _chart_and_helm_digest() -> str:
    binary = require_binaries(default_bin_dir())["helm"]
    digest = hashlib.sha256(f"{binary.resolve()}\0{binary.stat().st_size}\0{binary.stat().st_mtime_ns}".encode())
    for path in sorted(CHART.rglob("*")):
        if path.is_file():
            digest.update(f"\0{path.relative_to(CHART)}\0".encode())
            digest.update(path.read_bytes())
    return digest.hexdigest()


@functools.cache
def _template(release: str, args: tuple[str, ...], digest: str) -> str:
    kept = RENDERS / f"{digest}.yaml"
    if kept.is_file():
        return kept.read_text()
    result = helm("template", release, str(CHART), "--namespace", NAMESPACE, *args)
    assert result.returncode == 0, result.stderr
    RENDERS.mkdir(parents=True, exist_ok=True)
    partial = kept.with_suffix(f".{os.getpid()}.tmp")
    partial.write_text(result.stdout)
    partial.replace(kept)  # whole or absent, also with two xdist workers rendering the same command
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
