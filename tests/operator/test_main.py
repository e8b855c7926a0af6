"""``tandem operator`` command line (the flags the Helm chart passes) and its /healthz + /metrics server."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import aiohttp
import kopf
import pytest

from tandem.registry import EtcdTLS
from tandem_dev.procs import free_port
from tandem_operator.act.metrics import FENCES, serve
from tandem_operator.run.main import CustomResourceDiffBase, parse_args


def test_chart_flags_parse() -> None:
    args = parse_args(
        ["--etcd-endpoints=tandem-etcd.ops.svc:2379, http://10.0.0.9:2379", "--log-level=info", "--all-namespaces"]
    )
    assert args.etcd.endpoints == ["tandem-etcd.ops.svc:2379", "http://10.0.0.9:2379"]
    assert args.namespace == []
    assert args.leader_election is True
    assert args.leader_lease_duration + args.leader_retry < args.lease_ttl  # entries outlive a failover
    assert parse_args(["--namespace=a", "--namespace=b", "--no-leader-election"]).namespace == ["a", "b"]


def test_etcd_client_flags_make_one_settings_group(tmp_path: Path) -> None:
    """``--etcd-endpoints`` and the TLS flags shared with the router become ``args.etcd``, one group (#37)."""
    ca, cert, key = (tmp_path / name for name in ("ca.crt", "tls.crt", "tls.key"))
    for path in (ca, cert, key):
        path.write_text("PEM")
    args = parse_args(["--etcd-ca-file", str(ca), "--etcd-cert-file", str(cert), "--etcd-key-file", str(key),
                       "--etcd-server-name", "etcd.ops.svc"])  # fmt: skip
    assert args.etcd.tls == EtcdTLS(ca_file=str(ca), cert_file=str(cert), key_file=str(key), server_name="etcd.ops.svc")
    assert (args.etcd.endpoints, parse_args([]).etcd.tls) == ([], EtcdTLS())  # spec.etcd.endpoints; plaintext
    assert not {"etcd_ca_file", "etcd_endpoints"} & set(vars(args))  # the flags' values are the group's only


def test_bad_flags_are_named(capsys: pytest.CaptureFixture[str]) -> None:
    with pytest.raises(SystemExit):
        parse_args(["--namespace=a", "--all-namespaces"])
    assert "--all-namespaces: not allowed with argument --namespace" in capsys.readouterr().err
    with pytest.raises(SystemExit):
        parse_args(["--lease-ttl=1"])
    assert "--lease-ttl must be at least 2 seconds" in capsys.readouterr().err
    with pytest.raises(SystemExit):
        parse_args(["--lease-ttl=8", "--leader-lease-duration=8"])
    assert "must stay below --lease-ttl" in capsys.readouterr().err
    with pytest.raises(SystemExit):
        parse_args(["--leader-retry=0"])
    assert "--leader-retry must be positive" in capsys.readouterr().err
    assert parse_args(["--lease-ttl=8", "--leader-lease-duration=8", "--no-leader-election"]).lease_ttl == 8


async def test_healthz_and_metrics() -> None:
    port = free_port()
    runner = await serve("127.0.0.1", port)
    FENCES.labels("PodDeleted").inc()
    try:
        async with aiohttp.ClientSession() as session:
            async with session.get(f"http://127.0.0.1:{port}/healthz") as resp:
                assert (resp.status, await resp.text()) == (200, "ok")
            async with session.get(f"http://127.0.0.1:{port}/metrics") as resp:
                body = await resp.text()
        assert 'tandem_operator_fences_total{reason="PodDeleted"}' in body
        assert "tandem_operator_fence_seconds_bucket" in body
    finally:
        await runner.cleanup()


def test_kopf_builds_a_diff_base_for_custom_resources_only() -> None:
    storage = CustomResourceDiffBase(prefix="operator.tandem.dev", key="last-handled-spec")
    pod = kopf.Body({"apiVersion": "v1", "kind": "Pod", "metadata": {"name": "p"}, "spec": {"nodeName": "n"}})
    cluster = kopf.Body({"apiVersion": "tandem.dev/v1alpha1", "kind": "PDCluster", "spec": {"prefill": {"groups": 1}}})
    assert storage.build(body=pod) == {}
    assert storage.build(body=cluster)["spec"] == {"prefill": {"groups": 1}}


def test_the_operator_process_does_not_import_kubernetes_asyncio() -> None:
    """kopf imports it whenever it is installed; ``tandem_operator.cli`` keeps it out (~40 MiB of RSS). The modules
    loaded in a ``tandem operator`` process once it has parsed its flags (kopf and the REST client included)."""
    code = """
import json, sys
from tandem.cli import main
try:
    main(["operator", "--help"])
finally:
    print(json.dumps(sorted(name for name, module in sys.modules.items() if module is not None)), file=sys.stderr)
"""
    result = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=60, check=False)
    assert result.returncode == 0, result.stderr[-2000:]
    loaded = set(json.loads(result.stderr.splitlines()[-1]))
    assert {"kopf", "aiohttp", "tandem_operator.run.main", "tandem.kube.rest"} <= loaded
    assert not {name for name in loaded if name.split(".")[0] == "kubernetes_asyncio"}
