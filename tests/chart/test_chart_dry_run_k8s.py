"""Every manifest the chart renders is accepted by the real kube-apiserver (server-side dry run, strict field
validation: an unknown or misspelled field is an error, not a silently dropped key).

Covered: the CRDs, the chart with its defaults and with each ``deploy/values-*.yaml``, and the deploy/ PDCluster
examples against the installed CRDs. The test cluster has no Prometheus Operator, so its ServiceMonitor, PodMonitor and
PrometheusRule kinds are registered here as stand-in CRDs whose ``spec`` is not validated (the kinds, API
version and metadata are); the PrometheusRule's rules are checked by ``promtool`` in test_chart_monitoring.
"""

from __future__ import annotations

import asyncio
from typing import Any

import pytest
import pytest_asyncio
import yaml

from tandem_dev.devcluster.cluster import DevCluster
from tandem_operator.run.render import render, to_yaml
from tests.chart.stack import CHART, DEPLOY, tool

pytestmark = [pytest.mark.k8s, pytest.mark.timeout(180)]

VALUES_FILES = sorted(DEPLOY.glob("values-*.yaml"))


def _stand_in_crd(kind: str, plural: str) -> dict[str, Any]:
    schema = {"type": "object", "x-kubernetes-preserve-unknown-fields": True}
    return {
        "apiVersion": "apiextensions.k8s.io/v1",
        "kind": "CustomResourceDefinition",
        "metadata": {"name": f"{plural}.monitoring.coreos.com"},
        "spec": {
            "group": "monitoring.coreos.com",
            "scope": "Namespaced",
            "names": {"kind": kind, "plural": plural, "singular": kind.lower(), "listKind": f"{kind}List"},
            "versions": [{"name": "v1", "served": True, "storage": True, "schema": {"openAPIV3Schema": schema}}],
        },
    }


async def _dry_run(cluster: DevCluster, docs: list[dict[str, Any]]) -> None:
    """Server-side dry run of ``docs``; every object must be reported as accepted."""
    text = to_yaml(docs).encode()
    out = await tool(
        cluster, "kubectl", "apply", "--server-side", "--dry-run=server", "--validate=strict", "-f", "-", stdin=text
    )
    for doc in docs:
        name = doc["metadata"]["name"]
        assert f"/{name} serverside-applied (server dry run)" in out, f"{doc['kind']}/{name} not accepted:\n{out}"


async def _render(cluster: DevCluster, namespace: str, *args: str) -> list[dict[str, Any]]:
    out = await tool(cluster, "helm", "template", "tandem", str(CHART), "--namespace", namespace, *args)
    return [doc for doc in yaml.safe_load_all(out) if doc]


@pytest_asyncio.fixture(scope="module", loop_scope="module")
async def monitoring_kinds(k8s_cluster: DevCluster) -> None:
    docs = [
        _stand_in_crd("ServiceMonitor", "servicemonitors"),
        _stand_in_crd("PodMonitor", "podmonitors"),
        _stand_in_crd("PrometheusRule", "prometheusrules"),
    ]
    await tool(k8s_cluster, "kubectl", "apply", "--server-side", "-f", "-", stdin=yaml.safe_dump_all(docs).encode())
    await asyncio.to_thread(k8s_cluster.wait_established, [doc["metadata"]["name"] for doc in docs])


async def test_crds_and_deploy_examples_are_accepted(k8s_cluster: DevCluster, k8s_namespace: str) -> None:
    crds = [yaml.safe_load(path.read_text()) for path in sorted((CHART / "crds").glob("*.yaml"))]
    assert {crd["spec"]["names"]["kind"] for crd in crds} == {"PDCluster", "PDPool"}
    await _dry_run(k8s_cluster, crds)
    # The examples need the kinds to exist: install the CRDs as `helm install` would (it creates missing CRDs).
    await tool(k8s_cluster, "kubectl", "apply", "--server-side", "-f", str(CHART / "crds"))
    await asyncio.to_thread(k8s_cluster.wait_established, [crd["metadata"]["name"] for crd in crds])
    examples = []
    for path in (DEPLOY / "kimi-k26-h200.yaml", DEPLOY / "sim-small.yaml"):
        doc = yaml.safe_load(path.read_text())
        doc["metadata"]["namespace"] = k8s_namespace
        examples.append(doc)
    await _dry_run(k8s_cluster, examples)
    # The CEL side of the rule tests/chart/test_chart_mooncake_etcd.py checks in Python: a Mooncake Store with an
    # https:// registry etcd and no plaintext etcd of its own is refused.
    del examples[0]["spec"]["etcd"]["mooncakeEndpoints"]
    text = to_yaml(examples[:1]).encode()
    args = ("apply", "--server-side", "--dry-run=server", "--validate=strict", "-f", "-")
    out = await tool(k8s_cluster, "kubectl", *args, "-o", "name", check=False, stdin=text)
    assert "pdcluster" not in out.lower(), out


@pytest.mark.parametrize("values", [None, *VALUES_FILES], ids=lambda v: "defaults" if v is None else v.name)
async def test_rendered_chart_is_accepted(
    k8s_cluster: DevCluster, k8s_namespace: str, monitoring_kinds: None, values: Any
) -> None:
    docs = await _render(k8s_cluster, k8s_namespace, *(["-f", str(values)] if values else []))
    kinds = {doc["kind"] for doc in docs}
    assert {"Deployment", "ClusterRole", "Service"} <= kinds
    await _dry_run(k8s_cluster, docs)


@pytest.mark.parametrize("example", ["kimi-k26-h200.yaml", "sim-small.yaml"])
async def test_operator_worker_pods_are_accepted(k8s_cluster: DevCluster, k8s_namespace: str, example: str) -> None:
    """The pods, Services and disruption budgets the operator makes for each deploy/ example (``tandem render``),
    with their security contexts (privileged host InfiniBand, IPC_LOCK, seccomp) and requests."""
    doc = yaml.safe_load((DEPLOY / example).read_text())
    docs = [m for m in render(doc, k8s_namespace) if m["kind"] in ("Pod", "Service", "PodDisruptionBudget")]
    assert {d["kind"] for d in docs} == {"Pod", "Service", "PodDisruptionBudget"}
    await _dry_run(k8s_cluster, docs)
