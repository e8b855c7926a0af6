"""The Mooncake etcd: a plaintext etcd the chart deploys beside a registry etcd with TLS, because Mooncake's etcd
client has neither TLS nor users (mooncake-common/etcd/etcd_wrapper.go: ``NewEtcdClient`` and
``NewStoreEtcdClient`` build a ``clientv3.Config`` with endpoints and timeouts only). It holds the master's HA
leader key and the workers' Transfer Engine metadata, so it is deployed when the chart's master needs it
(``mooncakeEtcd.deploy: auto``) and wired into the master and the PDCluster the release's notes print. Its
NetworkPolicy flows are checked with the others in test_network_policy.py."""

from __future__ import annotations

import asyncio
import shutil
import sys
from pathlib import Path
from typing import Any

import pydantic
import pytest
import yaml

from tandem.registry_etcd import client
from tandem_dev.procs import ManagedProcess, free_port
from tandem_operator.api.pdcluster import PDClusterSpec
from tests.chart.render import CHART, NAMESPACE, ROOT, helm, render

RECIPE = ROOT / "deploy" / "kimi-k26-h200.yaml"
MOONCAKE_ETCD = "t-tandem-mooncake-etcd"


def _render(*sets: str) -> list[dict[str, Any]]:
    return render(*(a for s in sets for a in ("--set", s)))


def _named(docs: list[dict[str, Any]], kind: str, name: str) -> dict[str, Any] | None:
    found = [d for d in docs if d["kind"] == kind and d["metadata"]["name"] == name]
    return found[0] if found else None


def _master_etcd(docs: list[dict[str, Any]]) -> str:
    master = _named(docs, "Deployment", "t-tandem-mooncake-master")
    assert master is not None
    [flag] = [a for a in master["spec"]["template"]["spec"]["containers"][0]["command"] if "--etcd_endpoints" in a]
    return str(flag).removeprefix("--etcd_endpoints=")


def _errors(*sets: str) -> str:
    result = helm("template", "t", str(CHART), *(a for s in sets for a in ("--set", s)))
    assert result.returncode != 0
    return result.stderr


def test_registry_tls_and_a_master_deploy_a_plaintext_mooncake_etcd() -> None:
    docs = _render("mooncakeMaster.enabled=true")  # etcd.tls.enabled is the default
    sts = _named(docs, "StatefulSet", MOONCAKE_ETCD)
    assert sts is not None
    assert sts["spec"]["replicas"] == 3
    pod = sts["spec"]["template"]["spec"]
    [etcd] = pod["containers"]
    registry = _named(docs, "StatefulSet", "t-tandem-etcd")
    assert registry is not None
    assert etcd["image"] == registry["spec"]["template"]["spec"]["containers"][0]["image"]  # etcd.image
    urls = [a for a in etcd["command"] if a.startswith(("--listen-", "--advertise-", "--initial-"))]
    assert urls
    assert not [a for a in urls if "https://" in a]
    assert "--initial-cluster-token=t-tandem-mooncake-etcd" in etcd["command"]
    assert not [a for a in etcd["command"] if "cert" in a or "tls" in a.lower()]  # nothing Mooncake cannot speak
    assert "volumes" not in pod  # no certificate mounted; data on its own PVCs
    assert sts["spec"]["volumeClaimTemplates"][0]["spec"]["resources"]["requests"]["storage"] == "2Gi"
    assert etcd["readinessProbe"]["httpGet"] == {"path": "/health", "port": "client"}
    assert etcd["resources"]["requests"] == {"cpu": "100m", "memory": "256Mi"}
    assert pod["securityContext"]["runAsNonRoot"]
    assert etcd["securityContext"]["readOnlyRootFilesystem"]
    assert sts["spec"]["template"]["metadata"]["labels"]["app.kubernetes.io/component"] == "mooncake-etcd"
    assert _named(docs, "Service", MOONCAKE_ETCD) is not None
    assert _named(docs, "Service", f"{MOONCAKE_ETCD}-peers") is not None
    assert _named(docs, "NetworkPolicy", MOONCAKE_ETCD) is not None
    assert _master_etcd(docs) == f"{MOONCAKE_ETCD}.{NAMESPACE}.svc:2379"


def test_no_mooncake_etcd_where_mooncake_can_use_another() -> None:
    """TLS off (the registry etcd, as before), the user's own etcd, external registry etcd, or no master."""
    cases: list[tuple[tuple[str, ...], str | None]] = [
        (("etcd.tls.enabled=false", "mooncakeMaster.enabled=true"), f"t-tandem-etcd.{NAMESPACE}.svc:2379"),
        (("mooncakeMaster.enabled=true", "mooncakeMaster.etcdEndpoints={mc-0.mc:2379,mc-1.mc:2379}"),
         "mc-0.mc:2379;mc-1.mc:2379"),
        (("etcd.mode=external", "etcd.endpoints={ext:2379}", "mooncakeMaster.enabled=true"), "ext:2379"),
        ((), None),
        (("mooncakeEtcd.deploy=never", "etcd.tls.enabled=false", "mooncakeMaster.enabled=true"),
         f"t-tandem-etcd.{NAMESPACE}.svc:2379"),
    ]  # fmt: skip
    for sets, master_etcd in cases:
        docs = _render(*sets)
        assert not [d for d in docs if d["metadata"]["name"].startswith(MOONCAKE_ETCD)], sets
        if master_etcd is not None:
            assert _master_etcd(docs) == master_etcd, sets


def test_always_deploys_it_for_a_store_whose_master_runs_elsewhere() -> None:
    docs = _render("mooncakeEtcd.deploy=always", "mooncakeEtcd.replicas=1", "mooncakeEtcd.persistence.enabled=false")
    sts = _named(docs, "StatefulSet", MOONCAKE_ETCD)
    assert sts is not None
    assert sts["spec"]["replicas"] == 1
    assert sts["spec"]["template"]["spec"]["volumes"] == [{"name": "data", "emptyDir": {}}]
    assert "volumeClaimTemplates" not in sts["spec"]
    assert _named(docs, "Deployment", "t-tandem-mooncake-master") is None


def test_contradictory_values_are_refused_naming_the_key() -> None:
    assert "mooncakeEtcd.deploy: Mooncake's etcd client cannot use TLS" in _errors(
        "mooncakeMaster.enabled=true", "mooncakeEtcd.deploy=never"
    )
    assert "mooncakeEtcd.deploy: 'always' deploys a Mooncake etcd, but mooncakeMaster.etcdEndpoints" in _errors(
        "mooncakeEtcd.deploy=always", "mooncakeMaster.etcdEndpoints={mc:2379}"
    )
    assert "mooncakeEtcd.replicas: 2 members cannot keep quorum" in _errors(
        "mooncakeMaster.enabled=true", "mooncakeEtcd.replicas=2"
    )
    assert "/mooncakeEtcd/deploy" in _errors("mooncakeEtcd.deploy=sometimes")  # the schema's enum


def _notes(*args: str) -> str:
    result = helm("install", "tandem", str(CHART), "--namespace", NAMESPACE, "--dry-run=client", *args)
    assert result.returncode == 0, result.stderr
    return result.stdout.split("NOTES:", 1)[1]


def test_production_pair_wires_the_pdcluster_to_the_chart_etcds() -> None:
    """deploy/values-production.yaml turns the registry's TLS on and gets a Mooncake etcd; deploy/kimi-k26-h200.yaml
    (installed as release 'tandem' in 'serving', as its header says) names exactly the etcds the notes print."""
    values = ["-f", str(ROOT / "deploy" / "values-production.yaml")]
    prod = render(*values, release="tandem")
    assert _named(prod, "StatefulSet", "tandem-mooncake-etcd") is not None
    registry = _named(prod, "StatefulSet", "tandem-etcd")
    assert registry is not None
    assert "--client-cert-auth" in registry["spec"]["template"]["spec"]["containers"][0]["command"]
    printed = yaml.safe_load(_notes(*values).split("Its spec.etcd:", 1)[1].split("and watch", 1)[0])
    recipe = yaml.safe_load(RECIPE.read_text())["spec"]["etcd"]
    assert (
        printed
        == recipe
        == {
            "endpoints": ["https://tandem-etcd.serving.svc:2379"],
            "mooncakeEndpoints": ["http://tandem-mooncake-etcd.serving.svc:2379"],
        }
    )
    assert "mooncakeEndpoints" not in _notes("--set", "etcd.tls.enabled=false", "--set", "mooncakeMaster.enabled=true")


def test_a_store_on_a_tls_registry_etcd_needs_mooncake_endpoints() -> None:
    """The PDCluster side of the wiring: a Mooncake Store cannot reach an https:// etcd, so such a spec without
    spec.etcd.mooncakeEndpoints is refused (the same rule runs as CEL in the API server)."""
    spec = yaml.safe_load(RECIPE.read_text())["spec"]
    del spec["etcd"]["mooncakeEndpoints"]
    with pytest.raises(pydantic.ValidationError, match=r"etcd\.mooncakeEndpoints: a Mooncake Store"):
        PDClusterSpec.model_validate(spec)
    no_store = {**spec, "prefill": {**spec["prefill"], "hicache": {"enabled": False}}}
    assert PDClusterSpec.model_validate(no_store).etcd.mooncake == ["https://tandem-etcd.serving.svc:2379"]
    plain = {**spec, "etcd": {"endpoints": ["http://tandem-etcd.serving.svc:2379"]}}
    assert PDClusterSpec.model_validate(plain).etcd.mooncake == ["http://tandem-etcd.serving.svc:2379"]


def _command(docs: list[dict[str, Any]], kind: str, name: str) -> list[str]:
    workload = _named(docs, kind, name)
    assert workload is not None
    return [str(a) for a in workload["spec"]["template"]["spec"]["containers"][0]["command"]]


def _on_loopback(argv: list[str], names: dict[str, str]) -> list[str]:
    """A rendered command with the pod's names and ports replaced (``names``: rendered text -> loopback text)."""
    out = []
    for arg in argv:
        for rendered, local in names.items():
            arg = arg.replace(rendered, local)
        out.append(arg)
    return out


async def _keys(endpoint: str, prefix: bytes) -> list[bytes]:
    etcd = client([endpoint])
    await etcd.connect()
    try:
        return [kv.key for kv in await etcd.get_prefix(prefix)]
    finally:
        await etcd.close()


@pytest.mark.procs
@pytest.mark.timeout(120)
async def test_rendered_mooncake_etcd_serves_the_rendered_master(tmp_path: Path) -> None:
    """The chart's own commands, run on loopback: the Mooncake etcd member starts plaintext, and the Mooncake
    master (the mooncake 0.3.13 wheel's ``mooncake_master``) with the chart's flags wins its HA leader key there."""
    master_bin = Path(sys.executable).with_name("mooncake_master")
    assert master_bin.exists(), "the mooncake wheel (pyproject) ships mooncake_master"
    assert shutil.which("etcd"), "etcd-server (scripts/bootstrap.sh) is missing"
    docs = _render("mooncakeMaster.enabled=true", "mooncakeEtcd.replicas=1")
    member, cport, pport, rpc, metrics = f"{MOONCAKE_ETCD}-0", free_port(), free_port(), free_port(), free_port()
    etcd_argv = _on_loopback(
        _command(docs, "StatefulSet", MOONCAKE_ETCD),
        {
            "$(POD_NAME)": member,
            f"{member}.{MOONCAKE_ETCD}-peers.{NAMESPACE}.svc": "127.0.0.1",
            "0.0.0.0": "127.0.0.1",
            ":2379": f":{cport}",
            ":2380": f":{pport}",
            "=/var/lib/etcd": f"={tmp_path / 'etcd'}",
        },
    )
    master_argv = _on_loopback(
        _command(docs, "Deployment", "t-tandem-mooncake-master"),
        {
            f"{MOONCAKE_ETCD}.{NAMESPACE}.svc:2379": f"127.0.0.1:{cport}",
            "$(POD_IP)": "127.0.0.1",
            "--rpc_port=50051": f"--rpc_port={rpc}",
            "--metrics_port=9003": f"--metrics_port={metrics}",
        },
    )
    assert master_argv[0] == "mooncake_master"
    etcd = ManagedProcess("mooncake-etcd", etcd_argv, tmp_path / "etcd.log").start()
    master = ManagedProcess(
        "mooncake-master", [str(master_bin), *master_argv[1:]], tmp_path / "master.log", cwd=tmp_path
    )
    try:
        etcd.wait_http(f"http://127.0.0.1:{cport}/health", timeout=30)  # the readiness probe's URL, plaintext
        master.start()
        endpoint = f"127.0.0.1:{cport}"
        keys: list[bytes] = []
        async with asyncio.timeout(60):
            while not keys:
                assert master.alive(), master.log_tail()
                keys = await _keys(endpoint, b"mooncake-store/tandem/")
                await asyncio.sleep(0.5)
        assert b"mooncake-store/tandem/master_view" in keys, keys
    finally:
        master.stop()
        etcd.stop()
