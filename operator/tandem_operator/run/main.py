"""``tandem operator``: the kopf operator for PDCluster / PDPool.

Configuration: ``--kubeconfig`` (else in-cluster service account, else the default kubeconfig), namespaces to
serve (``--namespace``, repeatable, or ``--all-namespaces``, the default), ``--etcd-endpoints`` to reach the
registry's etcd by another route than the PDCluster's ``spec.etcd.endpoints``, ``--metrics-port`` for ``/healthz``
and ``/metrics``. Leader election over a Lease is on by default (any number of replicas is safe; kopf's own
peering is switched off, it only pauses lower-priority peers); ``--no-leader-election`` for a single local run.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import logging
import os
import socket
import sys
from collections.abc import Iterable, Sequence
from pathlib import Path
from typing import Any

import kopf
import pydantic
from pydantic import Field
from pydantic.fields import FieldInfo

from tandem import logs, settings_flags
from tandem.etcd_settings import EtcdClientSettings
from tandem.kube import credentials
from tandem.kube.rest import RestClient
from tandem.registry_signing import EndpointSigner
from tandem_operator.act.k8s.election import LeaderElector
from tandem_operator.act.k8s.kube import Kube
from tandem_operator.act.k8s.login import connection_info as login_info
from tandem_operator.act.metrics import KUBE_REQUESTS, LEADER, serve
from tandem_operator.run.handlers import OperatorState, build_registry
from tandem_operator.run.runtime import RuntimeOptions

log = logging.getLogger("tandem.operator")
SERVICE_ACCOUNT_NAMESPACE = Path("/var/run/secrets/kubernetes.io/serviceaccount/namespace")


def _namespace_of_pod() -> str:
    try:
        return SERVICE_ACCOUNT_NAMESPACE.read_text().strip()
    except OSError:
        return "default"


class OperatorEtcdSettings(EtcdClientSettings):
    """The registry etcd's client: the endpoints that override the PDClusters' ``spec.etcd.endpoints`` (empty: theirs)
    and the TLS settings shared with the router (``tandem.etcd_settings``); ``parse_args`` gives it as ``etcd``."""

    endpoints: list[str] = Field(
        default_factory=list, description="comma-separated etcd endpoints overriding spec.etcd.endpoints"
    )


_ETCD = {"etcd": FieldInfo.from_annotation(OperatorEtcdSettings)}  # the parsed arguments' settings group, args.etcd


def parse_args(argv: Sequence[str]) -> argparse.Namespace:
    """The operator's flags; the etcd client's as one ``OperatorEtcdSettings``, ``etcd`` (``etcd.endpoints``,
    ``etcd.tls``)."""
    parser = argparse.ArgumentParser(prog="tandem operator", description=__doc__)
    parser.add_argument("--kubeconfig", default=os.environ.get("KUBECONFIG"), help="kubeconfig file")
    scope = parser.add_mutually_exclusive_group()
    scope.add_argument("--namespace", action="append", default=[], help="namespace to serve (repeatable)")
    scope.add_argument("--all-namespaces", action="store_true", help="serve every namespace (the default)")
    endpoints = OperatorEtcdSettings.model_fields["endpoints"]
    parser.add_argument("--etcd-endpoints", default="", help=endpoints.description)  # one flag, comma-separated
    settings_flags.add_flags(parser, _ETCD, skip={"etcd_endpoints"})  # --etcd-ca-file ... as the router's
    parser.add_argument(
        "--registry-signing-key",
        help="Ed25519 private key (PEM) that signs every registry value; routers verify with its public key",
    )
    parser.add_argument(
        "--lease-ttl",
        type=int,
        default=15,
        help="etcd lease TTL of registry entries (s); longer than a leader failover, so entries survive one",
    )
    parser.add_argument("--resync", type=float, default=30.0, help="periodic reconcile of every cluster (s)")
    parser.add_argument("--metrics-port", type=int, default=0, help="serve /healthz and /metrics on this port")
    parser.add_argument("--metrics-host", default="0.0.0.0", help="address of the /healthz and /metrics server")
    parser.add_argument("--no-leader-election", dest="leader_election", action="store_false")
    parser.add_argument("--leader-election-namespace", default=os.environ.get("POD_NAMESPACE") or _namespace_of_pod())
    parser.add_argument("--leader-election-name", default="tandem-operator")
    parser.add_argument(
        "--leader-lease-duration",
        type=int,
        default=6,
        help="seconds a leader Lease lasts without renewal; a standby takes over after it (keep below --lease-ttl)",
    )
    parser.add_argument("--leader-retry", type=float, default=1.0, help="seconds between a standby's attempts")
    parser.add_argument("--identity", default=os.environ.get("POD_NAME") or f"{socket.gethostname()}-{os.getpid()}")
    parser.add_argument("--log-level", default="info")
    args = parser.parse_args(argv)
    if args.lease_ttl < 2:
        parser.error("--lease-ttl must be at least 2 seconds")
    if args.leader_lease_duration < 3:
        parser.error("--leader-lease-duration must be at least 3 seconds")
    if not 0 < args.leader_retry < args.leader_lease_duration:
        parser.error("--leader-retry must be positive and shorter than --leader-lease-duration")
    if args.leader_election and args.leader_lease_duration + args.leader_retry >= args.lease_ttl:
        parser.error(
            "--leader-lease-duration + --leader-retry must stay below --lease-ttl (registry entries would "
            "expire during a failover)"
        )
    args.etcd_endpoints = [e.strip() for e in args.etcd_endpoints.split(",") if e.strip()]  # etcd.endpoints
    for flag in ("etcd_ca_file", "etcd_cert_file", "etcd_key_file", "registry_signing_key"):
        path = getattr(args, flag)
        if path is not None and not Path(path).is_file():
            parser.error(f"--{flag.replace('_', '-')}: no such file: {path}")
    flat = {name: vars(args).pop(name) for name in settings_flags.flat_fields(_ETCD)}  # etcd_ca_file, ...
    try:
        args.etcd = OperatorEtcdSettings(**settings_flags.nest(flat, _ETCD)["etcd"])
    except pydantic.ValidationError as err:
        parser.error(f"--etcd-*-file: {err.errors()[0]['msg']}")
    return args


class CustomResourceDiffBase(kopf.AnnotationsDiffBaseStorage):
    """kopf builds a diff base (a deep copy of the whole body) for every event of every watched resource, though
    only the PDCluster's create/update handlers compare one. For pods and nodes (raw-event handlers) it is skipped:
    those copies were a quarter of the operator's CPU while a 1,000-pod fleet ramped up (py-spy)."""

    def build(self, *, body: kopf.Body, extra_fields: Iterable[Any] | None = None) -> kopf.BodyEssence:
        if body.get("apiVersion") == "v1":  # Pod, Node: no change-detecting handler
            return kopf.BodyEssence()
        return super().build(body=body, extra_fields=extra_fields)


def operator_settings(settings: kopf.OperatorSettings) -> None:
    settings.persistence.progress_storage = kopf.AnnotationsProgressStorage(prefix="operator.tandem.dev")
    settings.persistence.diffbase_storage = CustomResourceDiffBase(
        prefix="operator.tandem.dev", key="last-handled-spec"
    )
    settings.posting.level = logging.WARNING  # our own Events say what happened; kopf's only report failures
    settings.watching.server_timeout = 300
    settings.watching.chunk_size = 50  # list 1,000 nodes / pods a page at a time, not as one ~5 MB answer
    settings.networking.request_timeout = 30


async def run(args: argparse.Namespace) -> int:
    login = credentials.load(args.kubeconfig)
    http = await serve(args.metrics_host, args.metrics_port) if args.metrics_port else None
    try:
        async with RestClient(login, user_agent="tandem-operator") as rest:
            kube = Kube(rest, on_request=lambda method: KUBE_REQUESTS.labels(method).inc())
            return await _run_operator(args, login, kube)
    finally:
        if http is not None:
            await http.cleanup()


async def _run_operator(args: argparse.Namespace, login: credentials.Credentials, kube: Kube) -> int:
    stop = asyncio.Event()
    holder: asyncio.Task[None] | None = None
    elector: LeaderElector | None = None
    if args.leader_election:
        elector = LeaderElector(
            kube,
            name=args.leader_election_name,
            namespace=args.leader_election_namespace,
            identity=args.identity,
            duration_s=args.leader_lease_duration,
            retry_s=args.leader_retry,
        )
        log.info("waiting for leadership", extra={"identity": args.identity})
        await elector.acquire()
        LEADER.set(1)
        holder = asyncio.create_task(elector.hold())
        holder.add_done_callback(lambda _: stop.set())
    signer = EndpointSigner.from_file(args.registry_signing_key) if args.registry_signing_key else None
    state = OperatorState(
        kube,
        RuntimeOptions(args.identity, resync_seconds=args.resync),
        tuple(args.etcd.endpoints),
        args.lease_ttl,
        etcd_tls=args.etcd.tls,
        signer=signer,
    )
    registry = build_registry(state)

    @kopf.on.login(registry=registry)
    def connection_info(**_: Any) -> kopf.ConnectionInfo:
        return login_info(login)  # called again after a 401: a ServiceAccount token file is read afresh

    @kopf.on.startup(registry=registry)
    def configure(settings: kopf.OperatorSettings, **_: Any) -> None:
        operator_settings(settings)

    try:
        await kopf.operator(
            registry=registry,
            standalone=True,
            clusterwide=not args.namespace,
            namespaces=args.namespace,
            stop_flag=stop,
        )
    finally:
        LEADER.set(0)
    lost = holder is not None and holder.done()
    if holder is not None:
        holder.cancel()
    if elector is not None and not lost:
        with contextlib.suppress(Exception):  # best effort: the Lease expires by itself otherwise
            await elector.release()
    return 1 if lost else 0


def _drop_kopf_settings(record: logging.LogRecord) -> bool:
    """kopf attaches its whole settings object to every record; the JSON log line should not carry it."""
    record.__dict__.pop("settings", None)
    return True


def main(argv: Sequence[str]) -> int:
    args = parse_args(argv)
    logs.setup(args.log_level, "tandem.operator")
    for handler in logging.getLogger().handlers:
        handler.addFilter(_drop_kopf_settings)
    logging.getLogger("kopf.objects").setLevel(logging.WARNING)  # one line per handled event is noise at scale
    try:
        return asyncio.run(run(args))
    except KeyboardInterrupt:
        return 130
    except credentials.ConfigError as err:
        print(f"tandem operator: cannot configure the Kubernetes client: {err}", file=sys.stderr)
        return 2
