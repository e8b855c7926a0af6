"""The Helm chart rendered offline: lint, template for every values file, values validation messages."""

from __future__ import annotations

from collections.abc import Mapping
from pathlib import Path
from typing import Any

import pytest
import yaml
from pydantic.alias_generators import to_camel

from tandem import settings_flags
from tandem_dev.chart import generate
from tandem_dev.chart.dashboard import PANELS
from tandem_dev.chart.values import SETTINGS_VALUES, Router, router_setting_flags
from tandem_router.config import RouterSettings, parser
from tandem_router.flow.limits import FlowLimits, load_limits
from tests.chart.render import CHART, ROOT, VALUES_FILES, helm, render


def test_generated_files_are_current() -> None:
    for path, text in generate.rendered_files().items():
        assert path.read_text() == text, f"{path.relative_to(ROOT)} is stale: run `make generate`"


def test_every_values_key_is_documented() -> None:
    lines = (CHART / "values.yaml").read_text().splitlines()
    for i, line in enumerate(lines):
        stripped = line.strip()
        if stripped and not stripped.startswith("#") and ":" in stripped:
            assert lines[i - 1].strip().startswith("##"), f"values.yaml line {i + 1} has no doc comment: {line!r}"


def test_dashboard_panels_have_queries() -> None:
    assert PANELS
    doc = yaml.safe_load((CHART / "dashboards" / "tandem.json").read_text())
    assert [p["targets"][0]["expr"] for p in doc["panels"]] == [p.expr for p in PANELS]


@pytest.mark.parametrize("values", [None, *VALUES_FILES], ids=lambda p: "defaults" if p is None else p.name)
def test_lint_and_template(values: Path | None) -> None:
    extra = [] if values is None else ["-f", str(values)]
    lint = helm("lint", str(CHART), "--strict", *extra)
    assert lint.returncode == 0, lint.stdout + lint.stderr
    kinds = {doc["kind"] for doc in render(*extra)}
    assert {"Deployment", "Service", "ClusterRole"} <= kinds


@pytest.mark.parametrize(
    ("sets", "message"),
    [
        (["etcd.replicas=2"], "etcd.replicas: 2 members cannot keep quorum"),
        (["etcd.mode=external"], "etcd.endpoints: etcd.mode is 'external' but no endpoints are given"),
        (["router.hpa.enabled=true", "router.hpa.minReplicas=5", "router.hpa.maxReplicas=2"], "router.hpa.minReplicas"),
        (["router.pdb.minAvailable=2", "router.replicas=2"], "router.pdb.minAvailable: 2 would block"),
        (["router.replicas=abc"], "at '/router/replicas': got string, want integer"),
        (["router.bogus=1"], "additional properties 'bogus' not allowed"),
        (["router.policy=fastest"], "/router/policy"),
        (["router.service.type=LoadBalancer"], "networkPolicy.routerCidrs: a LoadBalancer router Service"),
        (["router.flowControl.limits.default.weight=-1"], "/router/flowControl/limits/default/weight"),
        (["router.flowControl.limits.defaults.weight=1"], "additional properties 'defaults' not allowed"),
        (["router.clientIdHeader=X Tenant"], "/router/clientIdHeader"),
        (["router.flowControl.clientIdHeader=X Tenant"], "/router/flowControl/clientIdHeader"),
    ],
)
def test_invalid_values_fail_with_the_key_named(sets: list[str], message: str) -> None:
    args = [arg for s in sets for arg in ("--set", s)]
    result = helm("template", "t", str(CHART), *args)
    assert result.returncode != 0
    assert message in result.stderr


def test_optional_components_render() -> None:
    result = helm(
        "template", "t", str(CHART),
        "--set", "etcd.mode=external", "--set", "etcd.endpoints[0]=etcd.example:2379",
        "--set", "metrics.prometheusRule.enabled=true", "--set", "metrics.serviceMonitor.enabled=true",
        "--set", "router.hpa.enabled=true", "--set", "mooncakeMaster.enabled=true",
    )  # fmt: skip
    assert result.returncode == 0, result.stderr
    docs = [d for d in yaml.safe_load_all(result.stdout) if d]
    kinds = {d["kind"] for d in docs}
    assert {"HorizontalPodAutoscaler", "PrometheusRule", "ServiceMonitor"} <= kinds
    assert "StatefulSet" not in kinds  # external etcd: no embedded members
    [rule] = [d for d in docs if d["kind"] == "PrometheusRule"]
    alerts = {r["alert"] for r in rule["spec"]["groups"][0]["rules"]}
    assert "TandemNoReadyPair" in alerts
    [router] = [d for d in docs if d["kind"] == "Deployment" and d["metadata"]["name"].endswith("-router")]
    args = router["spec"]["template"]["spec"]["containers"][0]["args"]
    assert "--etcd-endpoint=etcd.example:2379" in args
    assert "replicas" not in router["spec"]  # the HPA owns it


def _router(docs: list[dict[str, Any]]) -> dict[str, Any]:
    [router] = [d for d in docs if d["kind"] == "Deployment" and d["metadata"]["name"].endswith("-router")]
    pod: dict[str, Any] = router["spec"]["template"]["spec"]
    return pod


def test_flow_limits_come_from_a_configmap_the_router_reads(tmp_path: Path) -> None:
    limits = {"default": {"max_concurrency": 64}, "tenants": {"header:batch": {"weight": 0.5, "priority": -10}}}
    values = tmp_path / "values.yaml"
    values.write_text(yaml.safe_dump({"router": {"clientIdHeader": "X-Tenant", "flowControl": {"limits": limits}}}))
    docs = render("-f", str(values))
    [config_map] = [
        d for d in docs if d["kind"] == "ConfigMap" and d["metadata"]["name"] == "t-tandem-router-flow-limits"
    ]
    mounted = tmp_path / "limits.yaml"
    mounted.write_text(config_map["data"]["limits.yaml"])
    assert load_limits(mounted) == FlowLimits.model_validate(limits)  # the file the router parses, as given
    pod = _router(docs)
    args = pod["containers"][0]["args"]
    assert {"--flow-control", "--client-id-header=X-Tenant", "--flow-limits-file=/etc/tandem/flow/limits.yaml"} <= set(
        args
    )
    [mount] = [m for m in pod["containers"][0]["volumeMounts"] if m["name"] == "flow-limits"]
    assert mount["mountPath"] == "/etc/tandem/flow"
    assert "subPath" not in mount
    assert {"name": "flow-limits", "configMap": {"name": config_map["metadata"]["name"]}} in pod["volumes"]
    # no checksum annotation: a limits change is reloaded in place, it must not roll the routers
    assert not any("checksum" in k for k in (pod.get("metadata") or {}).get("annotations") or {})


def test_flow_control_defaults_render_no_limits_file() -> None:
    docs = render()
    assert not [d for d in docs if d["kind"] == "ConfigMap" and d["metadata"]["name"].endswith("-flow-limits")]
    args = _router(docs)["containers"][0]["args"]
    assert "--flow-control" in args
    assert not [a for a in args if a.startswith(("--flow-limits", "--client-id"))]
    off = _router(render("--set", "router.flowControl.enabled=false"))["containers"][0]["args"]
    assert "--no-flow-control" in off


def test_a_release_without_flow_control_values_upgrades_to_the_defaults() -> None:
    """`helm upgrade --reuse-values` from a release before router.flowControl existed brings no such key (caught by
    tests/chart/test_chart_upgrade_release_k8s.py: a nil pointer); the router gets the defaults."""
    docs = render("--set", "router.flowControl=null")
    args = _router(docs)["containers"][0]["args"]
    assert "--flow-control" in args
    assert not [a for a in args if a.startswith(("--flow-limits", "--client-id"))]


def _settings_from_flags(docs: list[dict[str, Any]]) -> dict[str, Any]:
    """The router's settings its rendered flags give, nested as ``RouterSettings`` nests them."""
    args = parser().parse_args(_router(docs)["containers"][0]["args"][1:])  # after the subcommand, `router`
    flags = {k: v for k, v in vars(args).items() if v is not None and k not in {"config", "pd_disaggregation"}}
    return settings_flags.nest(flags, RouterSettings.model_fields)


ROUTER_FIELD_OF = {field.alias or name: name for name, field in Router.model_fields.items()}  # value -> field


def _rendered_settings(tmp_path: Path, router_values: Mapping[str, Any]) -> dict[str, Any]:
    """The router's settings from the flags the chart renders with ``router_values``."""
    values = tmp_path / "values.yaml"
    values.write_text(yaml.safe_dump({"router": dict(router_values)}))
    return _settings_from_flags(render("-f", str(values)))


def test_router_values_keep_the_settings_names_and_reach_them(tmp_path: Path) -> None:
    """The router values that are router settings have the settings' names (camelCase, nested alike), and the
    chart's flags (``tandem.routerFlags``) give the router those settings: the router's own parser reads them."""
    router_values = {
        "policy": "power_of_two",
        "clientIdHeader": "X-Tenant",
        "maxConcurrentRequests": 77,
        "flowControl": {"enabled": False},
    }
    settings = _rendered_settings(tmp_path, router_values)
    for key, value in router_values.items():
        name = ROUTER_FIELD_OF[key]
        assert name in RouterSettings.model_fields, f"router.{key} is not named as a router setting"
        if isinstance(value, dict):
            assert {k: settings[name][k] for k in value} == value  # flowControl.enabled is flow_control.enabled
        else:
            assert settings[name] == value
    # the deprecated spelling still reaches the router where router.clientIdHeader is empty
    old = _settings_from_flags(render("--set", "router.flowControl.clientIdHeader=X-Old"))
    assert old["client_id_header"] == "X-Old"
    assert _settings_from_flags(render())["flow_control"] == {"enabled": True}


def test_router_settings_groups_reach_the_router_as_set(tmp_path: Path) -> None:
    """router.integrity, router.retry, router.cacheAware and flowControl's settings are the router's settings of the
    same names (generated from them, ``values.settings_values``): one set in each group lands on that setting through
    the rendered flags and the router's own parser; unset (null, the defaults) renders no flag of theirs."""
    router_values: dict[str, dict[str, Any]] = {
        "integrity": {"enabled": False, "canaryIntervalS": 12.5},
        "retry": {"maxAttempts": 3},
        "cacheAware": {"cacheThreshold": 0.75, "maxTreeUnits": 2_000_000},  # a float64 that Go would print as 2e+06
        "flowControl": {"reserveShare": 0.1, "workerPriority": True, "metricsTenants": 7},
    }
    settings = _rendered_settings(tmp_path, router_values)
    for group, given in router_values.items():
        name = ROUTER_FIELD_OF[group]
        assert name in SETTINGS_VALUES, f"router.{group} is not generated from a settings group"
        group_settings = SETTINGS_VALUES[name][0]
        assert RouterSettings.model_fields[name].annotation is group_settings
        setting_names = {to_camel(n): n for n in group_settings.model_fields}
        assert {setting_names[k]: v for k, v in given.items()} == {
            setting_names[k]: settings[name][setting_names[k]] for k in given
        }
    nested = RouterSettings.model_validate({**settings, "registry_verify_key": None, "etcd": {}})
    assert nested.integrity.enabled is False
    assert nested.integrity.canary_interval_s == 12.5
    assert nested.retry.max_attempts == 3
    assert nested.cache_aware.max_tree_units == 2_000_000
    assert nested.flow_control.worker_priority is True
    assert nested.flow_control.reserve_share == 0.1

    flags = router_setting_flags()
    generated = {flag for group in flags.values() for flag, _ in group.values()}
    options = {option for action in parser()._actions for option in action.option_strings}
    assert generated <= options
    assert {f"--no-{f[2:]}" for g in flags.values() for f, kind in g.values() if kind == "boolean"} <= options
    defaults = _router(render())["containers"][0]["args"]
    assert not [a for a in defaults if a.split("=")[0] in generated or a.removeprefix("--no-") in {
        f[2:] for f in generated}]  # fmt: skip
    assert _settings_from_flags(render())["flow_control"] == {"enabled": True}
