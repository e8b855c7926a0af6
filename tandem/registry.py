"""The etcd endpoint registry: key layout and value schema shared by the operator (writer) and router (reader).

One key per serving group (the group's rank-0 pod), written under a lease the writer keeps alive, so a writer
that dies stops advertising its endpoints after the lease TTL, and a writer that *fences* a group deletes the
key at once::

    /tandem/v1/clusters/<namespace>/<cluster>/endpoints/<role>/<group>  ->  Endpoint (JSON)

Values carry a schema version (``schema_version``): writers stamp the current one, readers use values one version
back or ahead and refuse the rest, ignoring the members they do not know (``tandem.registry_versions`` has the
rules and what a writer of the next version promises). The key's ``v1`` is the key layout, not the value schema.

This module is pure: no I/O. ``tandem.registry_etcd`` is the thin etcd adapter.
"""

from __future__ import annotations

from enum import StrEnum
from typing import Annotated, Any

from pydantic import BaseModel, ConfigDict, Field, PrivateAttr, StringConstraints, ValidationError, model_validator

from tandem.registry_versions import LEGACY_VERSION, SCHEMA_VERSION, EntryRefusedError, Refusal, canonical, read_object

ROOT = "/tandem/v1/clusters"

Name = Annotated[str, StringConstraints(pattern=r"^[a-z0-9]([-a-z0-9.]*[a-z0-9])?$", max_length=253)]
SessionId = Annotated[str, StringConstraints(pattern=r"^[^\s:]+:\d+$", max_length=64)]
# A Kubernetes label value (the node label naming the group's RDMA fabric domain: rack, rail group, NVLink domain).
FabricDomain = Annotated[str, StringConstraints(pattern=r"^[A-Za-z0-9]([-A-Za-z0-9_.]{0,61}[A-Za-z0-9])?$")]


class Role(StrEnum):
    PREFILL = "prefill"
    DECODE = "decode"


class FabricMode(StrEnum):
    """How routers treat a pair whose prefill and decode sit in different fabric domains (PDCluster
    ``spec.fabric.mode``): ``preferred`` uses it only when no same-domain pair is available, ``required`` never."""

    PREFERRED = "preferred"
    REQUIRED = "required"


# Fields added to version 1 after entries were first written: left out of a value (and of what is signed) while
# unset, so a version-1 entry without them verifies as an older operator signed it. Writers of every later version
# keep leaving them out while unset (tandem.registry_versions: a version N+1 value re-encodes as version N writes).
_OMITTED_WHEN_UNSET = ("fabric_domain", "fabric_mode")


class Endpoint(BaseModel):
    """What a router needs to send a request to one serving group, and to tell one incarnation from the next."""

    model_config = ConfigDict(frozen=True, extra="forbid")

    schema_version: int = Field(
        default=SCHEMA_VERSION,
        ge=1,
        description="Schema version of the value (tandem.registry_versions). Absent from values written before "
        "versions existed: version 1. Writers always stamp the current version (``encode``).",
    )
    role: Role
    group: Name = Field(description="Group name, unique within the cluster and role (e.g. 'decode-3').")
    url: str = Field(pattern=r"^https?://[^/\s]+$", description="HTTP base URL of the group's rank-0 SGLang server.")
    bootstrap_port: int | None = Field(
        default=None, ge=1, le=65535, description="Prefill bootstrap port (prefill only)."
    )
    mooncake_sessions: tuple[SessionId, ...] = Field(
        default=(),
        max_length=4096,
        description="Every Mooncake session id 'ip:port' the group's transfer engines may take: each pod's IP with "
        "each port of its window, rank by rank (exact with one port per engine). Peers key cached segment "
        "descriptors and pooled connections by these names, so an incarnation must not reuse one of an earlier "
        "incarnation's (the operator rotates the window by epoch); routers count a reuse.",
    )
    ib_devices: tuple[str, ...] = Field(default=(), description="RDMA devices the group transfers KV over.")
    attn_dp_size: int = Field(default=1, ge=1, description="Attention data-parallel size of the group.")
    model: str = Field(min_length=1, description="Served model name.")
    revision: str = Field(default="", description="Spec revision: routers pair only equal revisions.")
    epoch: int = Field(default=0, ge=0, description="Incremented each time the group is recreated.")
    fabric_domain: FabricDomain | None = Field(
        default=None,
        description="The RDMA fabric domain of the group: the value of the PDCluster's spec.fabric.domainLabel on "
        "the group leader's node (its other ranks share it). None: unknown (no fabric declared, an unlabelled node, "
        "or an entry of an older operator).",
    )
    fabric_mode: FabricMode | None = Field(
        default=None, description="spec.fabric.mode of the group's PDCluster. None: no fabric declared."
    )
    signature: str = Field(
        default="",
        max_length=128,
        description="The operator's Ed25519 signature (base64) of this key and value (``signed_payload``): routers "
        "given the operator's public key ignore an endpoint without a valid one (tandem.registry_signing).",
    )
    # Members of a newer version's value that this version does not know: never used, kept as read so that the
    # signature is checked over the whole stored value (``signed_payload``). Never written back (``encode``).
    _ignored: dict[str, Any] = PrivateAttr(default_factory=dict)

    @property
    def ignored_members(self) -> tuple[str, ...]:
        """Names of the stored members this version does not know (ignored)."""
        return tuple(sorted(self._ignored))


class SessionHistory:
    """Every Mooncake session id each group's incarnations registered, with the newest epoch that held it.

    A recreated group's ids repeat once its window rotation wraps (``desired/pods.py: rotate_window``: after as
    many recreations as the role's range has windows) at an address an earlier incarnation had (hostNetwork: the
    same node; pod networking: an IP handed out again). Peers may still hold that incarnation's descriptor and
    connections under the id, so a reuse is worth a count and a warning however many incarnations ago it was, not
    only against the previous one. Ids older than the newest ``limit`` per group are forgotten (oldest epoch
    first): a group spread over many addresses stays bounded.
    """

    def __init__(self, limit: int = 4096) -> None:
        self.limit = limit
        self._held: dict[str, dict[str, int]] = {}  # group key -> session id -> newest epoch that held it
        self._epoch: dict[str, int] = {}  # group key -> newest epoch seen

    def note(self, key: str, endpoint: Endpoint) -> dict[str, int]:
        """Record ``endpoint``; for a newer incarnation, its ids an earlier one held, with that one's epoch."""
        newest = self._epoch.get(key)
        if newest is not None and endpoint.epoch < newest:
            return {}  # a stale value: recorded ids are newer
        held = self._held.setdefault(key, {})
        reused = {} if endpoint.epoch == newest else {s: held[s] for s in endpoint.mooncake_sessions if s in held}
        self._epoch[key] = endpoint.epoch
        held.update(dict.fromkeys(endpoint.mooncake_sessions, endpoint.epoch))
        if len(held) > self.limit:
            for session, _ in sorted(held.items(), key=lambda item: item[1])[: len(held) - self.limit]:
                del held[session]
        return reused


def cluster_prefix(namespace: str, cluster: str) -> str:
    """Prefix of every endpoint key of one PD cluster (ends with '/')."""
    return f"{ROOT}/{namespace}/{cluster}/endpoints/"


def endpoint_key(namespace: str, cluster: str, endpoint: Endpoint) -> str:
    return f"{cluster_prefix(namespace, cluster)}{endpoint.role.value}/{endpoint.group}"


def signed_payload(key: str, endpoint: Endpoint) -> bytes:
    """What the operator signs: the registry key and the value without its signature, so a signed value cannot be
    replayed under another cluster's or group's key.

    From version 2 on, the value is the canonical JSON of the whole stored object (members this version does not
    know included, as read); a version-1 value (no version member) keeps version 1's payload: its members in the
    model's order, as the operators of that version signed it. A value cannot move from one form to the other
    without breaking its signature: only the canonical form holds a version member."""
    if endpoint.schema_version == LEGACY_VERSION:
        exclude = {"signature", "schema_version", *_unset(endpoint)}
        return key.encode() + b"\n" + endpoint.model_dump_json(exclude=exclude).encode()
    stored = {**endpoint.model_dump(mode="json", exclude={"signature", *_unset(endpoint)}), **endpoint._ignored}
    return key.encode() + b"\n" + canonical(stored)


def _unset(endpoint: Endpoint) -> set[str]:
    return {name for name in _OMITTED_WHEN_UNSET if getattr(endpoint, name) is None}


def stamped(endpoint: Endpoint) -> Endpoint:
    """The endpoint as this version writes it: the current schema version, no member this version does not know."""
    if endpoint.schema_version == SCHEMA_VERSION and not endpoint._ignored:
        return endpoint
    copy = endpoint.model_copy(update={"schema_version": SCHEMA_VERSION})
    copy._ignored = {}
    return copy


def encode(endpoint: Endpoint) -> bytes:
    """The value a writer of this version puts: stamped with the current schema version (``stamped``)."""
    endpoint = stamped(endpoint)
    return endpoint.model_dump_json(exclude=_unset(endpoint)).encode()


def decode(value: bytes) -> Endpoint:
    """Read a registry value of any version this reader uses (``tandem.registry_versions``): members it does not
    know are ignored (kept for the signature, ``ignored_members``), missing ones take their defaults. Raises
    ``EntryRefusedError`` (a ``ValueError``, ``reason`` and ``detail``) for a value it does not use."""
    version, obj = read_object(value)
    known = {name: v for name, v in obj.items() if name in Endpoint.model_fields}
    ignored = {name: v for name, v in obj.items() if name not in Endpoint.model_fields}
    if ignored and version == LEGACY_VERSION:
        detail = f"a version-1 value with members version 1 never had: {sorted(ignored)}"
        raise EntryRefusedError(Refusal.INVALID, detail)
    try:
        endpoint = Endpoint.model_validate({**known, "schema_version": version})
    except ValidationError as err:
        raise EntryRefusedError(Refusal.INVALID, str(err), version) from err
    endpoint._ignored = ignored
    return endpoint


class QuarantinedPair(BaseModel):
    """One (prefill, decode) pair a router stopped sending traffic to because its output was garbled."""

    model_config = ConfigDict(frozen=True, extra="forbid")

    prefill: str = Field(description="Prefill worker URL.")
    decode: str = Field(description="Decode worker URL.")
    reason: str = Field(description="What the integrity checks found (detector finding or failed canary).")
    since_s: float = Field(ge=0, description="Seconds the pair has been quarantined when the report was written.")


class RepeatOffender(BaseModel):
    """A worker that keeps failing integrity checks across quarantine cycles: the operator recreates its group."""

    model_config = ConfigDict(frozen=True, extra="forbid")

    role: Role
    worker: str = Field(description="Worker URL (the group's rank-0 server).")
    epoch: int = Field(ge=0, description="The incarnation that failed (the registry's epoch when reported).")
    quarantines: int = Field(ge=1, description="Times its pairs were quarantined, re-quarantines included.")
    reason: str = Field(description="The last integrity failure.")


class IntegrityReport(BaseModel):
    """A router's integrity state for one PD cluster, written under the router's lease (gone when it dies).

    The operator turns the union of all routers' reports into the PDCluster's ``IntegrityDegraded`` condition
    and one Event per pair that enters or leaves quarantine, and recreates the groups of repeat offenders."""

    model_config = ConfigDict(frozen=True, extra="forbid")

    router: str = Field(min_length=1, description="The reporting router instance (host:pid).")
    quarantined: tuple[QuarantinedPair, ...] = ()
    quarantined_workers: tuple[str, ...] = Field(default=(), description="Workers all of whose pairs are out.")
    repeat_offenders: tuple[RepeatOffender, ...] = Field(
        default=(), description="Workers whose pairs were quarantined again and again: recreate their groups."
    )


class EtcdTLS(BaseModel):
    """How a client reaches an etcd that serves TLS and asks for client certificates (paths of PEM files).

    The client certificate's CN is the etcd user whose roles limit what the client may read and write
    (``tandem.etcd_auth``). No ``ca_file``: plaintext, as before."""

    model_config = ConfigDict(frozen=True, extra="forbid")

    ca_file: str | None = Field(default=None, description="CA bundle that signed the etcd server certificates.")
    cert_file: str | None = Field(default=None, description="Client certificate (its CN is the etcd user).")
    key_file: str | None = Field(default=None, description="Private key of the client certificate.")
    server_name: str | None = Field(
        default=None, description="Name to check the server certificate against (default: the endpoint's host)."
    )

    @model_validator(mode="after")
    def _pair(self) -> EtcdTLS:
        if (self.cert_file is None) != (self.key_file is None):
            raise ValueError("etcd TLS: cert_file and key_file go together")
        if self.cert_file is not None and self.ca_file is None:
            raise ValueError("etcd TLS: a client certificate needs ca_file (the etcd server's CA)")
        return self

    @property
    def enabled(self) -> bool:
        return self.ca_file is not None


def integrity_prefix(namespace: str, cluster: str) -> str:
    """Prefix of the routers' integrity reports of one PD cluster (ends with '/')."""
    return f"{ROOT}/{namespace}/{cluster}/integrity/"


def integrity_key(namespace: str, cluster: str, router: str) -> str:
    return f"{integrity_prefix(namespace, cluster)}{router}"
