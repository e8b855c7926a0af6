"""Router configuration: one pydantic-settings model, filled from a YAML file, ``TANDEM_ROUTER_*`` environment
variables and the command line (SGLang-router compatible flags), in increasing priority. Each setting is declared
once, and its flag made from it; the etcd client's, the cache-aware policy's, retries', integrity's and flow
control's are grouped in nested models (``tandem.settings_flags.SettingsGroup``) whose settings keep their flat flags,
environment variables and ``--config`` keys (``--flow-reserve-share``, ``TANDEM_ROUTER_FLOW_RESERVE_SHARE``:
``flow_control.reserve_share``; ``--etcd-endpoint``, ``TANDEM_ROUTER_ETCD_ENDPOINTS``: ``etcd.endpoints``).
"""

from __future__ import annotations

import argparse
from collections.abc import Mapping, Sequence
from enum import StrEnum
from pathlib import Path
from typing import Any, ClassVar

import yaml
from pydantic import BaseModel, Field, FilePath, field_validator, model_validator
from pydantic_settings import BaseSettings, PydanticBaseSettingsSource, SettingsConfigDict

from tandem import settings_flags
from tandem.etcd_settings import EtcdClientSettings
from tandem.registry_signing import EndpointVerifier
from tandem_router.integrity.divergence import NEAR_TIE_NATS
from tandem_router.policy.cache_aware import CacheAwareConfig
from tandem_router.policy.fabric import FabricLocality
from tandem_router.policy.selection import Policy


class DiscoveryMode(StrEnum):
    STATIC = "static"
    ETCD = "etcd"
    KUBERNETES = "kubernetes"


class PrefillSpec(BaseModel):
    url: str = Field(pattern=r"^https?://[^/\s]+$")
    bootstrap_port: int | None = Field(default=None, ge=1, le=65535)
    attn_dp_size: int = Field(default=1, ge=1)


class RouterEtcdSettings(EtcdClientSettings):
    """The registry etcd's client: its endpoints and the TLS settings shared with the operator
    (``tandem.etcd_settings.EtcdClientSettings``); flags ``--etcd-endpoint`` (smg's spelling), ``--etcd-ca-file``..."""

    endpoints: list[str] = Field(
        default_factory=lambda: ["127.0.0.1:2379"],
        description="The registry etcd's client endpoints (repeat per member).",
    )


class CacheAwareSettings(settings_flags.SettingsGroup):
    """The cache_aware policy's settings (``policy/cache_aware.py``'s ``CacheAwareConfig``); flags as smg's."""

    flag_names: ClassVar[Mapping[str, str]] = {"max_tree_units": "cache_max_tree_units"}

    cache_threshold: float = Field(
        default=0.5, ge=0, le=1, description="cache_aware: share of the prompt the best prefix match must exceed."
    )
    balance_abs_threshold: int = Field(
        default=4096, ge=0, description="cache_aware: prefill work (tokens) beyond the cheapest that drops affinity."
    )
    balance_rel_threshold: float = Field(
        default=1.1, ge=1, description="cache_aware: ...and the ratio to the cheapest prefill's work it must exceed."
    )
    max_tree_units: int = Field(
        default=1 << 20, ge=1, description="cache_aware: token ids or characters remembered per prefill (LRU)."
    )

    @property
    def config(self) -> CacheAwareConfig:
        return CacheAwareConfig(**self.model_dump())


class RetrySettings(settings_flags.SettingsGroup):
    """Retries before a response's first byte (other pairs) and resumes of a stream after it."""

    flag_names: ClassVar[Mapping[str, str]] = {
        "max_attempts": "retry_max_attempts",
        "initial_backoff_s": "retry_initial_backoff_s",
    }

    max_attempts: int = Field(default=5, ge=1, le=20, description="Pairs tried per request before its first byte.")
    initial_backoff_s: float = Field(default=0.01, ge=0, description="Wait before the first retry; doubles per retry.")
    resume_max_attempts: int = Field(
        default=2, ge=0, le=10, description="Fresh pairs tried per stream after its first byte (0: never resume)."
    )
    resume_deadline_s: float = Field(default=30.0, gt=0, description="From a stream's break: no pair tried after.")


class IntegritySettings(settings_flags.SettingsGroup):
    """Output integrity: live detectors, canaries, shadows, quarantine and probation (router/README.md)."""

    flag_names: ClassVar[Mapping[str, str]] = {
        "enabled": "integrity",
        "independent_clients": "integrity_independent_clients",
        "near_tie_nats": "integrity_near_tie_nats",
    }

    enabled: bool = Field(default=True, description="Run the output-integrity detectors, canaries and quarantine.")
    canary_interval_s: float = Field(default=30.0, gt=0, description="Seconds between known-answer canary rounds.")
    canary_sample: int = Field(
        default=2, ge=1, description="Partners each prefill and decode is probed with per canary round (rotating)."
    )
    probe_budget_share: float = Field(
        default=0.01,
        gt=0,
        le=1,
        description="Share of the cluster's capacity (requests at once) canaries, bursts and confirmations may use.",
    )
    quarantine_threshold: int = Field(
        default=2, ge=1, description="Integrity failures within the window that quarantine a pair."
    )
    quarantine_window_s: float = Field(default=60.0, gt=0, description="Window over which integrity failures count.")
    quarantine_probe_initial_s: float = Field(
        default=5.0, gt=0, description="Wait before a quarantined pair's first probation; doubles per quarantine."
    )
    quarantine_probe_max_s: float = Field(default=300.0, gt=0, description="Longest wait before a probation.")
    quarantine_watch_s: float = Field(default=300.0, ge=0, description="After release, one failure re-quarantines.")
    probation_comparisons: int = Field(
        default=100, ge=1, description="Clean comparisons at live concurrency that release a pair on probation."
    )
    max_detector_ejection_share: float = Field(
        default=0.5, gt=0, le=1, description="Share of pairs detector findings alone may quarantine (min one pair)."
    )
    independent_clients: int = Field(
        default=2, ge=2, description="Clients with disjoint findings that quarantine without a canary/shadow."
    )
    report_after_quarantines: int = Field(
        default=3, ge=1, description="Quarantines of a worker's pairs after which it is reported for recreation."
    )
    shadow_rate: float = Field(
        default=0.01, ge=0, le=1, description="Fraction of deterministic requests re-run on a second pair and compared."
    )
    leak_ngram_words: int = Field(default=8, ge=3, le=64, description="Words of another prompt that count as a leak.")
    near_tie_nats: float = Field(
        default=NEAR_TIE_NATS,
        ge=0,
        le=10,
        description="Largest top-1 minus runner-up logprob margin at which a flipped token is GPU numerics, not "
        "corruption (canaries, shadows, probation; 0: only exact ties).",
    )


class FlowControlSettings(settings_flags.SettingsGroup):
    """Tenant flow control (router/README.md, 'Tenant flow control'); the chart's ``router.flowControl``."""

    flag_prefix: ClassVar[str] = "flow_"
    flag_names: ClassVar[Mapping[str, str]] = {"enabled": "flow_control"}

    enabled: bool = Field(
        default=True,
        description="Tenant flow control: per-tenant queues in front of the pairs, weighted fair sharing of the "
        "capacity learned from the decodes' gauges, the limits of flow_limits_file (router/README.md).",
    )
    limits_file: Path | None = Field(
        default=None,
        description="YAML/JSON file of per-tenant weights, priorities and limits, reloaded when it changes "
        "(a malformed one is refused, naming the field, and the last good one kept). Unset: every tenant equal.",
    )
    reserve_share: float = Field(
        default=0.25,
        ge=0,
        le=0.5,
        description="Share of the learned capacity held for tenants below their fair share (at least 1 request).",
    )
    headroom_share: float = Field(
        default=0.5,
        ge=0,
        le=4,
        description="Requests admitted beyond the learned capacity, as a share of it: a short queue on the workers "
        "so that prefills overlap decoding (only tenants below their fair share use it).",
    )
    share_linger_s: float = Field(
        default=0.5,
        ge=0,
        le=60,
        description="Seconds a tenant that went idle keeps its share (checked every 0.5 s): a tenant between two "
        "requests, or whose client stalled a moment, does not hand its share to a flood that would hold it for a "
        "whole request (0: at once).",
    )
    worker_priority: bool = Field(
        default=False,
        description="Send each request's effective priority to the workers as SGLang's `priority` field (turn on "
        "where they run --enable-priority-scheduling).",
    )
    metrics_tenants: int = Field(
        default=20, ge=0, le=1000, description="Tenants with metric series of their own; the rest are 'other'."
    )


class RouterSettings(BaseSettings):
    """Every setting of the router; ``etcd`` (its TLS settings shared with the operator), ``cache_aware``, ``retry``,
    ``integrity`` and ``flow_control`` are groups (their settings' flags flat: ``settings_flags.flat_fields``)."""

    model_config = SettingsConfigDict(env_prefix="TANDEM_ROUTER_", env_nested_delimiter="__", extra="forbid")

    host: str = Field(default="127.0.0.1", description="Address the router listens on.")
    port: int = Field(default=8000, ge=0, le=65535, description="Port the router listens on (0: any free one).")
    workers: int = Field(default=1, ge=1, le=64, description="Router processes sharing the port (SO_REUSEPORT).")
    policy: Policy = Field(default=Policy.CACHE_AWARE, description="How a prefill/decode pair is chosen.")
    cache_aware: CacheAwareSettings = Field(
        default_factory=CacheAwareSettings, description="The cache_aware policy's thresholds and tree size."
    )
    fabric_locality: FabricLocality = Field(
        default=FabricLocality.AUTO,
        description="Pairs within one RDMA fabric domain (the registry's fabric_domain): preferred (first, else "
        "any), required (only; none -> 503), off (ignored), or auto: what the workers' registry entries say "
        "(PDCluster spec.fabric.mode), preferred where they say nothing.",
    )
    prefill: list[PrefillSpec] = Field(
        default_factory=list,
        description="Static discovery: a prefill's URL and its bootstrap port (repeat per prefill).",
    )
    decode: list[str] = Field(default_factory=list, description="Static discovery: a decode's URL (repeat per decode).")
    model_names: list[str] = Field(default_factory=list, description="Served model names; else learned from workers.")

    discovery: DiscoveryMode = Field(
        default=DiscoveryMode.STATIC, description="Where the workers come from: flags, the etcd registry or pods."
    )
    etcd: RouterEtcdSettings = Field(
        default_factory=RouterEtcdSettings, description="Etcd discovery: the registry etcd's endpoints and TLS."
    )
    registry_verify_key: FilePath | None = Field(
        default=None,
        description="The operator's Ed25519 public key (PEM): registry endpoints without its valid signature are "
        "ignored, logged and counted (tandem_router_registry_forged_endpoints). Unset: every endpoint is trusted.",
    )
    registry_panic_share: float = Field(
        default=0.5,
        gt=0,
        le=1,
        description="Share of the registry's workers removed within registry_panic_window_s that is a removal storm: "
        "the removed workers stay in routing while the router's health checks pass (registry_guard).",
    )
    registry_panic_min_removals: int = Field(
        default=2, ge=1, description="Fewest removals within the window that can be a storm (one fence never is)."
    )
    registry_panic_window_s: float = Field(default=10.0, gt=0, description="Window over which removals are counted.")
    registry_settle_s: float = Field(
        default=30.0,
        gt=0,
        description="A storm's held workers are removed once the registry, connected, went this long without "
        "naming them again or removing another.",
    )
    cluster_namespace: str = Field(default="default", description="Etcd discovery: the PDCluster's namespace.")
    cluster_name: str = Field(default="tandem", description="Etcd discovery: the PDCluster's name.")
    k8s_namespace: str = Field(default="default", description="Kubernetes discovery: the workers' namespace.")
    k8s_prefill_selector: str = Field(default="", description="Kubernetes discovery: label selector of prefill pods.")
    k8s_decode_selector: str = Field(default="", description="Kubernetes discovery: label selector of decode pods.")
    k8s_worker_port: int = Field(
        default=30000, ge=1, le=65535, description="Kubernetes discovery: the workers' HTTP port."
    )

    api_keys: list[str] = Field(default_factory=list, description="Accepted Bearer keys; empty: no auth.")
    max_body_bytes: int = Field(default=8 * 1024 * 1024, ge=1024, description="Largest request body accepted (413).")
    max_concurrent_requests: int = Field(
        default=4096, ge=1, description="Requests in flight beyond which a new one gets 503."
    )
    retry: RetrySettings = Field(default_factory=RetrySettings, description="Retries and stream resumes.")
    breaker_threshold: int = Field(default=5, ge=1, description="Consecutive failures that open a worker's breaker.")
    breaker_cooldown_s: float = Field(default=2.0, gt=0, description="An open breaker's wait before it lets one try.")
    health_interval_s: float = Field(default=2.0, gt=0, description="Seconds between health checks of each worker.")
    connect_timeout_s: float = Field(default=2.0, gt=0, description="Longest wait for a connection to a worker.")
    read_idle_timeout_s: float = Field(
        default=300.0, gt=0, description="Longest silence of a worker's response before it counts as failed."
    )
    drain_timeout_s: float = Field(default=30.0, ge=0, description="On SIGTERM: longest wait for requests in flight.")

    integrity: IntegritySettings = Field(default_factory=IntegritySettings, description="Output integrity.")
    client_id_header: str | None = Field(
        default=None, description="Header naming the client (set by a trusted proxy); else API key or peer address."
    )
    flow_control: FlowControlSettings = Field(default_factory=FlowControlSettings, description="Tenant flow control.")
    log_level: str = Field(default="info", description="debug, info, warning or error.")

    @classmethod
    def settings_customise_sources(
        cls,
        settings_cls: type[BaseSettings],
        init_settings: PydanticBaseSettingsSource,
        env_settings: PydanticBaseSettingsSource,
        dotenv_settings: PydanticBaseSettingsSource,
        file_secret_settings: PydanticBaseSettingsSource,
    ) -> tuple[PydanticBaseSettingsSource, ...]:
        """``TANDEM_ROUTER_<FLAG>`` for every setting, grouped ones included (``settings_flags.FlatEnvSource``)."""
        return init_settings, settings_flags.FlatEnvSource(settings_cls), dotenv_settings, file_secret_settings

    @model_validator(mode="before")
    @classmethod
    def _flat_names(cls, data: Any) -> Any:
        """A grouped setting is also taken by its flag's name (``flow_reserve_share: 0.1``, as a ``--config`` file
        or keyword argument): ``settings_flags.nest``."""
        return settings_flags.nest(data, cls.model_fields) if isinstance(data, Mapping) else data

    @model_validator(mode="after")
    def _verify_key(self) -> RouterSettings:
        if self.registry_verify_key is not None:
            EndpointVerifier.from_file(self.registry_verify_key)  # raises ValueError naming a wrong key
        return self

    @field_validator("decode")
    @classmethod
    def _urls(cls, value: list[str]) -> list[str]:
        for url in value:
            PrefillSpec(url=url)
        return value


def _prefill_arg(values: list[str]) -> dict[str, Any]:
    if not 1 <= len(values) <= 2:
        raise argparse.ArgumentTypeError("--prefill takes URL [BOOTSTRAP_PORT]")
    spec: dict[str, Any] = {"url": values[0].rstrip("/")}
    if len(values) == 2 and values[1].lower() not in {"none", "null"}:
        spec["bootstrap_port"] = values[1]
    return spec


# Flags whose name is not the field's, dashed: SGLang router's spelling (one flag per value, repeated).
_FLAG_NAMES = {"model_names": "--model-name", "etcd_endpoints": "--etcd-endpoint", "api_keys": "--api-key"}
_METAVARS = {"prefill": "URL [BOOTSTRAP_PORT]", "decode": "URL", "etcd_endpoints": "HOST:PORT", "model_names": "NAME",
             "api_keys": "KEY"}  # fmt: skip


def flag_of(name: str) -> str:
    """The command-line flag of the ``RouterSettings`` setting of flat name ``name`` (``settings_flags.flat_fields``:
    a field's name, or a grouped setting's, ``flow_reserve_share`` for ``flow_control.reserve_share``)."""
    return settings_flags.flag_of(name, _FLAG_NAMES)


def parser() -> argparse.ArgumentParser:
    """One flag per ``RouterSettings`` setting, grouped ones included (``tandem.settings_flags``; ``--prefill URL
    [BOOTSTRAP_PORT]`` repeated), plus ``--config`` and SGLang router's no-op ``--pd-disaggregation``."""
    p = argparse.ArgumentParser(prog="tandem router", description="OpenAI-compatible prefill/decode router.")
    p.add_argument("--config", type=Path, help="YAML file with RouterSettings fields (flags win)")
    p.add_argument("--pd-disaggregation", action="store_true", help="accepted for SGLang-router compatibility")
    prefill = RouterSettings.model_fields["prefill"]
    p.add_argument(flag_of("prefill"), dest="prefill", help=prefill.description, nargs="+", action="append",
                   metavar=_METAVARS["prefill"])  # fmt: skip
    settings_flags.add_flags(p, RouterSettings.model_fields, renamed=_FLAG_NAMES, metavars=_METAVARS, skip={"prefill"})
    return p


def load(argv: Sequence[str]) -> RouterSettings:
    """Parse flags over file over environment. Raises ``SystemExit`` (argparse) or ``pydantic.ValidationError``."""
    args = parser().parse_args(list(argv))
    values: dict[str, Any] = {}
    if args.config is not None:
        loaded = yaml.safe_load(args.config.read_text()) or {}
        if not isinstance(loaded, dict):
            raise SystemExit(f"tandem router: {args.config}: expected a mapping of settings")
        values.update(loaded)
    flags = {k: v for k, v in vars(args).items() if v is not None and k not in {"config", "pd_disaggregation"}}
    if "prefill" in flags:
        flags["prefill"] = [_prefill_arg(v) for v in flags["prefill"]]
    if "decode" in flags:
        flags["decode"] = [u.rstrip("/") for u in flags["decode"]]
    values = settings_flags.nest(values, RouterSettings.model_fields)
    # a flag wins over the file's value of its setting, also where the file nests it under its group
    for key, value in settings_flags.nest(flags, RouterSettings.model_fields).items():
        both = isinstance(value, dict) and isinstance(values.get(key), dict)
        values[key] = {**values[key], **value} if both else value
    return RouterSettings(**values)  # init values win over TANDEM_ROUTER_* environment variables
