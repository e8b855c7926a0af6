"""``charts/tandem`` values as a pydantic model: the single source of truth.

``python -m tandem_dev.chart.generate`` writes ``values.yaml`` (every key documented from its field description, in
the bitnami ``## @param`` style) and ``values.schema.json`` (enforced by Helm on install/upgrade/template).
Cross-field rules a JSON schema cannot say live in ``templates/_helpers.tpl`` (``tandem.validateValues``).
"""

from __future__ import annotations

from collections.abc import Collection
from typing import TYPE_CHECKING, Annotated, Any, Literal

from pydantic import BaseModel, ConfigDict, Field, StringConstraints, create_model
from pydantic.alias_generators import to_camel
from pydantic.fields import FieldInfo

from tandem.settings_flags import SettingsGroup, kind_of
from tandem_router import config as router_config
from tandem_router.flow.limits import FlowLimits

Quantity = str
DnsLabel = Annotated[str, StringConstraints(pattern=r"^[a-z0-9]([-a-z0-9]*[a-z0-9])?$", max_length=63)]


class Values(BaseModel):
    model_config = ConfigDict(alias_generator=to_camel, populate_by_name=True, extra="forbid")


class Image(Values):
    repository: str = Field(default="ghcr.io/tandem-dev/tandem", min_length=1, description="Image repository.")
    tag: str = Field(default="", description="Image tag; empty means the chart's appVersion.")
    pull_policy: Literal["Always", "IfNotPresent", "Never"] = Field(
        default="IfNotPresent", description="Image pull policy."
    )


class Resources(Values):
    requests: dict[str, Quantity] = Field(default_factory=dict, description="Resource requests (e.g. cpu, memory).")
    limits: dict[str, Quantity] = Field(default_factory=dict, description="Resource limits (e.g. memory).")


class Operator(Values):
    enabled: bool = Field(default=True, description="Deploy the Tandem operator.")
    replicas: int = Field(default=1, ge=1, le=5, description="Operator replicas (>1 uses leader election).")
    log_level: Literal["debug", "info", "warning", "error"] = Field(default="info", description="Log level.")
    watch_namespaces: list[str] = Field(
        default_factory=list, description="Namespaces to watch for PDClusters; empty means all namespaces."
    )
    resources: Resources = Field(
        default_factory=lambda: Resources(requests={"cpu": "100m", "memory": "256Mi"}, limits={"memory": "1Gi"}),
        description="Operator container resources.",
    )


class RouterService(Values):
    type: Literal["ClusterIP", "NodePort", "LoadBalancer"] = Field(default="ClusterIP", description="Service type.")
    port: int = Field(default=8000, ge=1, le=65535, description="Service port of the OpenAI-compatible endpoint.")


class Pdb(Values):
    enabled: bool = Field(default=True, description="Create a PodDisruptionBudget for the router.")
    min_available: int = Field(default=1, ge=0, description="Routers kept available during voluntary disruptions.")


class Hpa(Values):
    enabled: bool = Field(default=False, description="Create a HorizontalPodAutoscaler for the router.")
    min_replicas: int = Field(default=2, ge=1, description="HPA minimum replicas.")
    max_replicas: int = Field(default=10, ge=1, description="HPA maximum replicas.")
    target_cpu_utilization: int = Field(default=70, ge=1, le=100, description="HPA target CPU utilization (%).")


CLIENT_ID_HEADER = r"^[A-Za-z0-9-]*$"


def _shown(value: Any) -> str:
    return str(value).lower() if isinstance(value, bool) else repr(value)


def _setting_value(group: type[SettingsGroup], name: str, field: FieldInfo) -> tuple[Any, Any]:
    """A router setting as a chart value: its type and constraints or null (the default: the router's own),
    described by the setting's description, its flag and the router's default."""
    kind = kind_of(field.annotation)
    typed = Annotated[(kind, *field.metadata)] if field.metadata else kind
    flag = router_config.flag_of(group.flat_name(name))
    default = _shown(field.get_default(call_default_factory=True))
    description = f"{field.description} Flag {flag}; null: the router's default ({default})."
    return typed | None, Field(default=None, description=description)


# Router values generated from a settings group (``settings_values``): the group and the settings it holds, by the
# Router field's name; ``router_setting_flags`` gives ``tandem.routerFlags`` their flags.
SETTINGS_VALUES: dict[str, tuple[type[SettingsGroup], tuple[str, ...]]] = {}


def settings_values(
    field: str, group: type[SettingsGroup], doc: str, *, base: type[Values] = Values, skip: Collection[str] = ()
) -> type[Values]:
    """The chart values of the router's settings group ``group`` (``RouterSettings.<field>``): a model of every
    setting of the group but ``skip`` (on top of ``base``'s values), named as the setting (camelCase), of its type
    and constraints, or null (the default) for the router's own default: no flag is rendered for it."""
    names = tuple(name for name in group.model_fields if name not in skip)
    SETTINGS_VALUES[field] = (group, names)
    fields: dict[str, Any] = {name: _setting_value(group, name, group.model_fields[name]) for name in names}
    model: type[Values] = create_model(to_camel(field)[:1].upper() + to_camel(field)[1:], __base__=base, **fields)
    model.__doc__ = doc
    return model


def router_setting_flags() -> dict[str, dict[str, list[str]]]:
    """For ``tandem.routerFlags`` (generated into ``templates/_router_settings.tpl``): each generated router value
    (group, camelCase setting) with its flag and JSON schema type (``boolean``: ``--x``/``--no-x``)."""
    kinds = {bool: "boolean", int: "integer", float: "number"}
    flags: dict[str, dict[str, list[str]]] = {}
    for field, (group, names) in SETTINGS_VALUES.items():
        flags[to_camel(field)] = {
            to_camel(name): [
                router_config.flag_of(group.flat_name(name)),
                kinds[kind_of(group.model_fields[name].annotation)],
            ]
            for name in names
        }
    return flags


class _FlowControl(Values):
    """The router's ``flow_control`` settings (``tandem_router.config.FlowControlSettings``), by the same names;
    ``limits`` is the content of its ``limits_file``."""

    enabled: bool = Field(
        default=True,
        description="Tenant flow control: per-tenant queues in front of the pairs, weighted fair sharing of the "
        "capacity learned from the decodes (router/README.md, 'Tenant flow control').",
    )
    client_id_header: str = Field(
        default="",
        pattern=CLIENT_ID_HEADER,
        description="Deprecated: router.clientIdHeader (the router's client identity, for integrity evidence too); "
        "used where that is empty.",
    )
    limits: FlowLimits | None = Field(
        default=None,
        description="Per-tenant weights, priorities and limits (the limits file: 'default' and 'tenants', "
        "router/README.md), mounted from a ConfigMap and reloaded by the routers without a restart; null: every "
        "tenant equal, no limits.",
    )


_FLOW_DOC = _FlowControl.__doc__ or ""
if TYPE_CHECKING:
    FlowControl = _FlowControl
    CacheAware = Values
    Retry = Values
    Integrity = Values
else:
    FlowControl = settings_values(
        "flow_control", router_config.FlowControlSettings, _FLOW_DOC, base=_FlowControl, skip={"enabled", "limits_file"}
    )
    CacheAware = settings_values(
        "cache_aware", router_config.CacheAwareSettings, "The router's ``cache_aware`` settings, by the same names."
    )
    Retry = settings_values("retry", router_config.RetrySettings, "The router's ``retry`` settings, by the same names.")
    Integrity = settings_values(
        "integrity", router_config.IntegritySettings, "The router's ``integrity`` settings, by the same names."
    )


class Router(Values):
    """The router. Its settings (``tandem_router.config.RouterSettings``) keep their names here, camelCase and nested
    as the settings are (``policy``, ``clientIdHeader``, ``maxConcurrentRequests``, ``flowControl.enabled`` for
    ``flow_control.enabled``; ``integrity``, ``retry``, ``cacheAware`` and the rest of ``flowControl`` generated from
    the settings groups, a null one passing no flag: the router's default), but ``processes`` (``workers``) and
    ``drainTimeoutSeconds`` (``drain_timeout_s``, also the pods' grace period); ``templates/_helpers.tpl``'s
    ``tandem.routerFlags`` maps them all to the router's flags."""

    enabled: bool = Field(default=True, description="Deploy the router.")
    replicas: int = Field(default=2, ge=1, description="Router replicas (ignored when the HPA is enabled).")
    cluster_name: str = Field(
        default="kimi-k26",
        pattern=r"^[a-z0-9]([-a-z0-9]*[a-z0-9])?$",
        description="Name of the PDCluster (in the release namespace) whose registered endpoints the router serves.",
    )
    policy: Literal["round_robin", "power_of_two", "cache_aware", "random"] = Field(
        default="cache_aware", description="Pair-selection policy."
    )
    processes: int = Field(default=2, ge=1, le=64, description="Router processes per pod (SO_REUSEPORT).")
    api_keys_secret: str = Field(
        default="",
        description="Secret with a key 'api-keys' (comma-separated Bearer keys); empty means no authentication.",
    )
    client_id_header: str = Field(
        default="",
        pattern=CLIENT_ID_HEADER,
        description="Header naming the client (the tenant of flow control, the client of integrity evidence), set "
        "by a trusted proxy in front of the router (clients cannot pick their identity otherwise); empty: the API "
        "key when keys are checked, else the peer address.",
    )
    max_concurrent_requests: int = Field(default=4096, ge=1, description="Requests in flight per router before 429.")
    drain_timeout_seconds: int = Field(default=30, ge=0, description="Graceful drain bound on SIGTERM.")
    pre_stop_sleep_seconds: int = Field(
        default=5,
        ge=0,
        le=60,
        description="Seconds a terminating router keeps accepting before SIGTERM (preStop sleep), so Service "
        "endpoints drop it first and no new connection is refused during a rollout; 0 disables.",
    )
    service: RouterService = Field(default_factory=RouterService, description="Router Service.")
    pdb: Pdb = Field(default_factory=Pdb, description="Router PodDisruptionBudget.")
    hpa: Hpa = Field(default_factory=Hpa, description="Router HorizontalPodAutoscaler.")
    cache_aware: CacheAware = Field(
        default_factory=CacheAware,
        description="The cache_aware policy's thresholds and tree size (null: the router's defaults).",
    )
    retry: Retry = Field(default_factory=Retry, description="Retries and stream resumes (null: the router's defaults).")
    integrity: Integrity = Field(
        default_factory=Integrity,
        description="Output integrity: detectors, canaries, shadows, quarantine (null: the router's defaults).",
    )
    flow_control: FlowControl = Field(default_factory=FlowControl, description="Tenant flow control.")
    resources: Resources = Field(
        default_factory=lambda: Resources(requests={"cpu": "1", "memory": "512Mi"}, limits={"memory": "2Gi"}),
        description="Router container resources.",
    )


class Persistence(Values):
    enabled: bool = Field(default=True, description="Keep etcd data on PersistentVolumeClaims (kept on uninstall).")
    size: Quantity = Field(default="8Gi", description="PVC size per member.")
    storage_class: str = Field(default="", description="StorageClass; empty means the cluster default.")


class EtcdTls(Values):
    enabled: bool = Field(
        default=True,
        description="Embedded etcd: server and peer TLS, client certificates, one etcd user per component "
        "(operator read-write, routers read-only on endpoints) and operator-signed endpoints routers verify. "
        "Mode 'external' is not wired (the chart passes no certificates).",
    )
    cert_manager: Literal["auto", "always", "never"] = Field(
        default="auto",
        description="Certificates from cert-manager ('auto': when its cert-manager.io/v1 API exists); otherwise "
        "the chart generates them once at install and keeps them on upgrade (rotation: charts/tandem/README.md).",
    )
    issuer: str = Field(
        default="",
        description="cert-manager Issuer (same namespace) signing the etcd certificates; empty: the chart makes "
        "a self-signed CA Issuer of its own.",
    )
    validity_days: int = Field(
        default=365, ge=1, le=3650, description="Lifetime of the certificates the chart generates (no cert-manager)."
    )


class Etcd(Values):
    mode: Literal["embedded", "external"] = Field(
        default="embedded", description="'embedded': a StatefulSet in this release; 'external': use endpoints."
    )
    replicas: int = Field(default=3, ge=1, description="Embedded etcd members (odd: 1, 3 or 5).")
    image: str = Field(default="quay.io/coreos/etcd:v3.6.6", min_length=1, description="Embedded etcd image.")
    endpoints: list[str] = Field(
        default_factory=list, description="External etcd endpoints 'host:port' (mode 'external')."
    )
    persistence: Persistence = Field(default_factory=Persistence, description="Embedded etcd storage.")
    tls: EtcdTls = Field(
        default_factory=EtcdTls, description="TLS, client certificates and roles of the embedded etcd."
    )
    resources: Resources = Field(
        default_factory=lambda: Resources(requests={"cpu": "200m", "memory": "512Mi"}),
        description="Embedded etcd container resources.",
    )


class MooncakeMaster(Values):
    enabled: bool = Field(
        default=False, description="Deploy the Mooncake Store master (HiCache L3 for decode KV offload) in HA on etcd."
    )
    replicas: int = Field(default=2, ge=1, le=5, description="Master replicas; one leads via an etcd lease.")
    image: str = Field(
        default="lmsysorg/sglang:v0.5.23", min_length=1, description="Image that has the mooncake_master binary."
    )
    cluster_id: str = Field(default="tandem", min_length=1, description="Mooncake Store cluster id (etcd key scope).")
    etcd_endpoints: list[str] = Field(
        default_factory=list,
        description="A plaintext etcd 'host:port' list of your own for the master's HA (and the PDCluster's "
        "spec.etcd.mooncakeEndpoints); empty: the chart's Mooncake etcd (mooncakeEtcd) if deployed, else the "
        "registry etcd.",
    )
    rpc_port: int = Field(default=50051, ge=1, le=65535, description="Master RPC port.")
    metrics_port: int = Field(default=9003, ge=1, le=65535, description="Master metrics port.")
    resources: Resources = Field(
        default_factory=lambda: Resources(requests={"cpu": "500m", "memory": "1Gi"}, limits={"memory": "4Gi"}),
        description="Mooncake master container resources.",
    )


class MooncakeEtcd(Values):
    deploy: Literal["auto", "always", "never"] = Field(
        default="auto",
        description="A plaintext etcd for Mooncake's own keys (master HA, Transfer Engine metadata), since "
        "Mooncake's etcd client has no TLS: 'auto' deploys it when the registry etcd has TLS (etcd.tls.enabled), "
        "mooncakeMaster.enabled and mooncakeMaster.etcdEndpoints is empty; 'always' also for a Mooncake Store "
        "without this chart's master; 'never'. NetworkPolicy: only workers, the Mooncake master and the operator.",
    )
    replicas: int = Field(default=3, ge=1, description="Members (odd: 1, 3 or 5); image: etcd.image.")
    persistence: Persistence = Field(
        default_factory=lambda: Persistence(size="2Gi"), description="Mooncake etcd storage."
    )
    resources: Resources = Field(
        default_factory=lambda: Resources(requests={"cpu": "100m", "memory": "256Mi"}, limits={"memory": "1Gi"}),
        description="Mooncake etcd container resources.",
    )


class ServiceMonitor(Values):
    enabled: bool = Field(default=False, description="Create Prometheus Operator ServiceMonitors.")
    interval: str = Field(default="15s", description="Scrape interval.")


class WorkerPodMonitor(Values):
    enabled: bool = Field(
        default=False, description="Create a Prometheus Operator PodMonitor selecting every worker group's leader pod."
    )
    interval: str = Field(default="15s", description="Scrape interval.")
    namespaces: list[str] = Field(
        default_factory=list, description="Namespaces of the PDClusters to scrape ([]: every namespace)."
    )


class PrometheusRule(Values):
    enabled: bool = Field(default=False, description="Create a PrometheusRule with Tandem's alerts.")


class Dashboards(Values):
    enabled: bool = Field(default=True, description="Ship the Grafana dashboard as a ConfigMap.")
    label: str = Field(default="grafana_dashboard", description="Label the Grafana sidecar selects dashboards by.")


class Metrics(Values):
    service_monitor: ServiceMonitor = Field(default_factory=ServiceMonitor, description="ServiceMonitor settings.")
    worker_pod_monitor: WorkerPodMonitor = Field(
        default_factory=WorkerPodMonitor,
        description="PodMonitor of the SGLang worker pods (sglang:* gauges, KV-transfer failures).",
    )
    prometheus_rule: PrometheusRule = Field(default_factory=PrometheusRule, description="Alerting rules.")
    dashboards: Dashboards = Field(default_factory=Dashboards, description="Grafana dashboard ConfigMap.")


class Peer(Values):
    """Pods allowed in: those matching ``podLabels`` in the namespaces matching ``namespaceLabels``."""

    namespace_labels: dict[str, str] = Field(
        default_factory=dict, description="Labels of the namespaces allowed in ({}: every namespace)."
    )
    pod_labels: dict[str, str] = Field(
        default_factory=dict, description="Labels of the pods allowed in ({}: every pod)."
    )


NAMESPACE_NAME = "kubernetes.io/metadata.name"


class NetworkPolicy(Values):
    enabled: bool = Field(
        default=True,
        description="Create ingress NetworkPolicies: only Tandem's own pods and the peers below reach Tandem's ports.",
    )
    router_from: list[Peer] = Field(
        default_factory=lambda: [Peer(namespace_labels={NAMESPACE_NAME: "ingress-nginx"})],
        description="Who may call the router's OpenAI endpoint (besides monitoring and this release's helm test); "
        "a list, so a values file replaces it whole.",
    )
    router_cidrs: list[str] = Field(
        default_factory=list,
        description="Addresses outside the cluster allowed to the router (CIDRs: a LoadBalancer's clients).",
    )
    monitoring_from: list[Peer] = Field(
        default_factory=lambda: [
            Peer(namespace_labels={NAMESPACE_NAME: "monitoring"}, pod_labels={"app.kubernetes.io/name": "prometheus"})
        ],
        description="Who may scrape metrics: router, operator, worker HTTP (leaders' /metrics), Mooncake master.",
    )
    worker_clusters: list[DnsLabel] = Field(
        default_factory=list,
        description="PDClusters in the release namespace whose workers may reach each other on every port (NCCL, "
        "torch.distributed, Mooncake) and the Mooncake etcd; []: router.clusterName only.",
    )
    worker_cidrs: list[str] = Field(
        default_factory=list,
        description="Addresses of hostNetwork workers (the GPU nodes' CIDRs) allowed to the Mooncake etcd (the "
        "registry etcd without TLS) and the Mooncake master: a hostNetwork pod connects from its node's address, "
        "which no pod selector matches.",
    )
    worker_namespaces: list[DnsLabel] = Field(
        default_factory=list,
        description="Other namespaces whose worker pods may reach the Mooncake etcd (the registry etcd without "
        "TLS) and the Mooncake master (PDClusters outside the release namespace).",
    )


class ChartValues(Values):
    image: Image = Field(default_factory=Image, description="The Tandem image (operator and router).")
    image_pull_secrets: list[str] = Field(default_factory=list, description="Pull secrets for every pod.")
    operator: Operator = Field(default_factory=Operator, description="The operator.")
    router: Router = Field(default_factory=Router, description="The OpenAI-compatible router.")
    etcd: Etcd = Field(default_factory=Etcd, description="The etcd holding the endpoint registry.")
    mooncake_master: MooncakeMaster = Field(default_factory=MooncakeMaster, description="Mooncake Store master.")
    mooncake_etcd: MooncakeEtcd = Field(
        default_factory=MooncakeEtcd, description="The Mooncake etcd (beside a registry etcd with TLS)."
    )
    metrics: Metrics = Field(default_factory=Metrics, description="Prometheus and Grafana integration.")
    network_policy: NetworkPolicy = Field(
        default_factory=NetworkPolicy, description="NetworkPolicies (ingress) of every Tandem pod."
    )
