"""The thin etcd adapter of ``tandem.registry`` (aetcd): clients and a prefix watcher. The writing side, keys under
one kept-alive lease, is ``tandem.leased_writer``. Every call of a client made here raises ``EtcdError``
(``tandem.etcd_errors``) when it fails.

- ``EndpointWatcher`` lists a cluster's prefix, then watches it from the next revision: a PUT upserts, a DELETE
  (or lease expiry) removes the endpoint at once. It re-lists after a lost connection, so the callbacks always
  converge to etcd's current content. A value the router does not use (malformed, or of a schema version it does
  not read: ``tandem.registry_versions``) is logged with its key and why, counted, and handled as if its key were
  absent; it never crashes the router nor touches other keys.
"""

from __future__ import annotations

import asyncio
import contextlib
import functools
import ipaddress
import logging
import socket
from collections.abc import AsyncIterator, Awaitable, Callable, Sequence
from pathlib import Path
from typing import Any, Generic, TypeVar

import aetcd
import grpc
from aetcd import rpc, rtypes, watcher

from tandem import registry
from tandem.etcd_errors import EtcdError, as_etcd_errors
from tandem.registry import Endpoint, EtcdTLS
from tandem.registry_versions import EntryRefusedError, Relation, SchemaCensus, relation

log = logging.getLogger("tandem.registry")

T = TypeVar("T")
OnSnapshot = Callable[[dict[str, Endpoint]], None]
OnPut = Callable[[str, Endpoint], None]
OnDelete = Callable[[str], None]


def parse_endpoint_url(endpoint: str) -> tuple[str, int]:
    """``host:port`` (or ``http://host:port``) of an etcd client URL."""
    hostport = endpoint.split("://", 1)[-1].rstrip("/")
    host, _, port = hostport.rpartition(":")
    if not host or not port.isdigit():
        raise ValueError(f"etcd endpoint must be host:port, got {endpoint!r}")
    return host, int(port)


def grpc_target(endpoints: Sequence[str]) -> str:
    """One gRPC target naming every etcd member, so a client reaches whichever is up.

    gRPC's default ``pick_first`` policy connects to the first address that answers and, when that connection
    breaks, to the first that answers again (the RPC in flight fails; the next one goes to a live member). One
    endpoint stays a plain ``host:port`` (gRPC's DNS resolver already tries every address of a name); several are
    listed with the ``ipv4:``/``ipv6:`` scheme, names resolved here, each time a client is made.
    """
    hostports = [parse_endpoint_url(e) for e in endpoints]
    if not hostports:
        raise ValueError("no etcd endpoint given")
    if len(hostports) == 1:
        return "{}:{}".format(*hostports[0])
    v6 = [_ipv6_literal(host) for host, _ in hostports]
    if any(v6):
        if not all(v6):
            raise ValueError(f"etcd endpoints mix IPv6 literals with other hosts: {list(endpoints)}")
        return "ipv6:" + ",".join(f"[{ip}]:{port}" for ip, (_, port) in zip(v6, hostports, strict=True))
    addresses = [f"{ip}:{port}" for host, port in hostports for ip in _ipv4_addresses(host)]
    if not addresses:
        raise ValueError(f"no etcd endpoint resolves to an IPv4 address: {list(endpoints)}")
    return "ipv4:" + ",".join(dict.fromkeys(addresses))


def _ipv6_literal(host: str) -> str | None:
    try:
        return str(ipaddress.IPv6Address(host.strip("[]")))
    except ValueError:
        return None


def _ipv4_addresses(host: str) -> list[str]:
    try:
        return [str(ipaddress.IPv4Address(host))]
    except ValueError:
        pass
    try:
        infos = socket.getaddrinfo(host, None, socket.AF_INET, socket.SOCK_STREAM)
    except socket.gaierror as err:
        log.warning("etcd endpoint does not resolve; left out", extra={"host": host, "error": str(err)})
        return []
    return sorted({str(info[4][0]) for info in infos})


def _raising_etcd_errors(name: str) -> Callable[..., Awaitable[Any]]:
    """aetcd.Client's coroutine method ``name``, raising ``EtcdError`` in place of aetcd's and gRPC's exceptions."""
    method = getattr(aetcd.Client, name)

    async def call(self: Client, *args: Any, **kwargs: Any) -> Any:
        with as_etcd_errors(name, self.endpoint):
            return await method(self, *args, **kwargs)

    return functools.wraps(method)(call)


class Client(aetcd.Client):  # type: ignore[misc]
    """aetcd's client whose calls raise ``tandem.etcd_errors.EtcdError`` (named after the call and ``endpoint``):
    the one place where etcd failures get their type. A watch's events raise it too."""

    def __init__(self, host: str, port: int, timeout: int, endpoint: str) -> None:
        super().__init__(host=host, port=port, timeout=timeout)
        self.endpoint = endpoint

    get = _raising_etcd_errors("get")
    get_prefix = _raising_etcd_errors("get_prefix")
    put = _raising_etcd_errors("put")
    delete = _raising_etcd_errors("delete")
    delete_prefix = _raising_etcd_errors("delete_prefix")
    transaction = _raising_etcd_errors("transaction")
    lease = _raising_etcd_errors("lease")
    refresh_lease = _raising_etcd_errors("refresh_lease")
    revoke_lease = _raising_etcd_errors("revoke_lease")

    async def connect(self) -> None:
        with as_etcd_errors("connect", self.endpoint):
            await self._dial()

    async def _dial(self) -> None:
        await super().connect()

    async def watch(self, *args: Any, **kwargs: Any) -> Any:
        """aetcd's ``watch`` (``watch_prefix`` calls it), its events' failures raised as ``EtcdError`` too."""
        with as_etcd_errors("watch", self.endpoint):
            watch = await super().watch(*args, **kwargs)

        async def events() -> AsyncIterator[Any]:
            with as_etcd_errors("watch", self.endpoint):
                async for event in watch:
                    yield event

        return rtypes.Watch(events, watch.cancel, watch.watch_id)


class TlsClient(Client):
    """The client over a TLS channel with a client certificate (aetcd 1.0.0 dials only ``insecure_channel``).

    ``_dial`` is aetcd's ``Client.connect`` with ``grpc.aio.secure_channel`` in place of ``insecure_channel``;
    etcd takes the certificate's CN as the user, so no token is needed (``--client-cert-auth``)."""

    def __init__(self, host: str, port: int, timeout: int, endpoint: str, tls: EtcdTLS, server_name: str) -> None:
        super().__init__(host, port, timeout, endpoint)
        self._tls, self._server_name = tls, server_name

    async def _dial(self) -> None:
        if self._connected.is_set():
            return
        credentials = grpc.ssl_channel_credentials(
            _read(self._tls.ca_file), _read(self._tls.key_file), _read(self._tls.cert_file)
        )
        options = [("grpc.ssl_target_name_override", self._server_name), ("grpc.default_authority", self._server_name)]
        self.channel = rpc.secure_channel(f"{self._host}:{self._port}", credentials, options=options)
        self.kvstub = rpc.KVStub(self.channel)
        self.clusterstub = rpc.ClusterStub(self.channel)
        self.leasestub = rpc.LeaseStub(self.channel)
        self.maintenancestub = rpc.MaintenanceStub(self.channel)
        self.auth_stub = rpc.AuthStub(self.channel)
        self._watcher = watcher.Watcher(rpc.WatchStub(self.channel), timeout=self._timeout, metadata=None)
        self._connected.set()


def _read(path: str | None) -> bytes | None:
    return Path(path).read_bytes() if path else None


def client(endpoints: Sequence[str], timeout: int = 5, tls: EtcdTLS | None = None) -> Client:
    """A client over every endpoint (``grpc_target``); any live member serves (etcd forwards to the leader).
    With ``tls``: over TLS, the server certificate checked against ``tls.server_name`` or the first endpoint's host
    (one name for every member: the chart's certificate names all of them)."""
    # aetcd dials f"{host}:{port}": splitting the target at its last colon hands it over unchanged.
    host, _, port = grpc_target(endpoints).rpartition(":")
    endpoint = ",".join(endpoints)
    if tls is None or not tls.enabled:
        return Client(host, int(port), timeout, endpoint)
    server_name = tls.server_name or parse_endpoint_url(endpoints[0])[0].strip("[]")
    return TlsClient(host, int(port), timeout, endpoint, tls, server_name)


CLOSE_TIMEOUT_S = 2.0


async def close_client(etcd: Any, within: float = CLOSE_TIMEOUT_S) -> None:
    """Close an aetcd client, never waiting more than ``within`` seconds nor raising.

    ``aetcd.Client.close`` first shuts its watcher down, which waits for the watch stream to end; with the member
    that served the stream just killed, that wait never ended (seen as a router/operator watcher whose ``stop()``
    hung). Past ``within`` the gRPC channel is closed directly, which cancels every call on it.
    """
    try:
        async with asyncio.timeout(within):
            await etcd.close()
        return
    except TimeoutError:
        log.warning("etcd client close timed out; closing its channel", extra={"within_s": within})
    except Exception as err:  # closing is no etcd call (no EtcdError): a broken client; release its channel
        log.debug("etcd client close failed", extra={"error": repr(err)})
    channel = getattr(etcd, "channel", None)
    if channel is not None:
        with contextlib.suppress(Exception, TimeoutError):
            async with asyncio.timeout(within):
                await channel.close()


class PrefixWatcher(Generic[T]):
    """Lists an etcd prefix, then watches it from the next revision, calling ``on_change`` with the whole current
    set (key -> parsed value) after the listing and after every event. A PUT upserts, a DELETE (or a lease expiry)
    drops the key, a value ``parse`` rejects (None) drops it too (``skipped``: the keys whose value it rejected).
    After a lost connection it re-lists, so the set always converges to etcd's content."""

    def __init__(
        self,
        endpoints: Sequence[str],
        prefix: str,
        parse: Callable[[bytes, bytes], T | None],
        on_change: Callable[[dict[str, T]], Awaitable[None]],
        retry_s: float = 1.0,
        tls: EtcdTLS | None = None,
    ) -> None:
        self.endpoints, self.tls = list(endpoints), tls
        self.prefix = prefix.encode()
        self.parse, self.on_change, self.retry_s = parse, on_change, retry_s
        self.synced = asyncio.Event()
        self.connected = False  # listed and watching now; False from a lost connection until the next listing
        self.skipped: set[str] = set()  # keys present in etcd whose value ``parse`` rejected
        self._task: asyncio.Task[None] | None = None

    def start(self) -> None:
        self._task = asyncio.create_task(self._run(), name=f"etcd-watch-{self.prefix.decode()}")

    async def stop(self) -> None:
        """Cancel the watch and wait for it to end, cancelling again while it has not.

        One cancel is not always enough: on Python 3.11 ``asyncio.wait_for`` loses a cancellation that arrives as
        the awaited future completes (cpython gh-86296), and aetcd waits for a watch to be created with
        ``wait_for``; a stop landing right then left the task watching forever and ``stop()`` hung (seen when the
        watched member had just died and the watch was being re-created on another one).
        """
        if self._task is None:
            return
        while not self._task.done():
            self._task.cancel()
            await asyncio.wait({self._task}, timeout=1.0)
        with contextlib.suppress(asyncio.CancelledError, Exception):  # a failure was logged where it happened
            self._task.result()

    async def _run(self) -> None:
        while True:
            etcd: Any = None
            try:
                etcd = client(self.endpoints, tls=self.tls)
                await etcd.connect()
                await self._list_and_watch(etcd)
            except asyncio.CancelledError:
                raise
            except EtcdError as err:
                log.warning("etcd watch lost; re-listing", extra={"prefix": self.prefix.decode(), "error": str(err)})
            except Exception:  # last resort: a parser's or a callback's bug must not end the watch for good
                log.exception("etcd watch failed; re-listing", extra={"prefix": self.prefix.decode()})
            finally:
                self.connected = False
                if etcd is not None:
                    await close_client(etcd)
            await asyncio.sleep(self.retry_s)

    async def _list_and_watch(self, etcd: Any) -> None:
        listing = await etcd.get_prefix(self.prefix)
        current: dict[str, T] = {}
        self.skipped = set()
        for kv in listing:
            value = self.parse(kv.key, kv.value)
            if value is not None:
                current[kv.key.decode()] = value
            else:
                self.skipped.add(kv.key.decode())
        await self.on_change(dict(current))
        self.synced.set()
        self.connected = True
        async for event in await etcd.watch_prefix(self.prefix, start_revision=listing.header.revision + 1):
            key = event.kv.key.decode()
            value = None if event.kind == "DELETE" else self.parse(event.kv.key, event.kv.value)
            if value is None:
                current.pop(key, None)
            else:
                current[key] = value
            if value is None and event.kind != "DELETE":
                self.skipped.add(key)
            else:
                self.skipped.discard(key)
            await self.on_change(dict(current))


class EndpointWatcher(PrefixWatcher[Endpoint]):
    """The router's view of one cluster's endpoints: ``on_snapshot`` after a (re-)listing, then ``on_put`` and
    ``on_delete`` per change, so a deleted (fenced) endpoint is dropped at once. ``census``: each key's schema
    relation (refused values: ``unsupported``) and the refusals so far, for the router's metrics."""

    def __init__(
        self,
        endpoints: Sequence[str],
        namespace: str,
        cluster: str,
        *,
        on_snapshot: OnSnapshot,
        on_put: OnPut,
        on_delete: OnDelete,
        retry_s: float = 1.0,
        tls: EtcdTLS | None = None,
    ) -> None:
        prefix = registry.cluster_prefix(namespace, cluster)
        super().__init__(endpoints, prefix, self._parse, self._changed, retry_s, tls)
        self.on_snapshot, self.on_put, self.on_delete = on_snapshot, on_put, on_delete
        self.census = SchemaCensus()
        self._known: dict[str, Endpoint] | None = None

    async def _list_and_watch(self, etcd: Any) -> None:
        self._known = None  # a (re-)listing is reported whole
        await super()._list_and_watch(etcd)

    async def _changed(self, current: dict[str, Endpoint]) -> None:
        self.census.by_key = {key: relation(ep.schema_version) for key, ep in current.items()}
        self.census.by_key.update(dict.fromkeys(self.skipped, Relation.UNSUPPORTED))
        if self._known is None:
            self.on_snapshot(dict(current))
        else:
            for key in self._known.keys() - current.keys():
                self.on_delete(key)
            for key, endpoint in current.items():
                if self._known.get(key) != endpoint:
                    self.on_put(key, endpoint)
        self._known = current

    def _parse(self, key: bytes, value: bytes) -> Endpoint | None:
        try:
            endpoint = registry.decode(value)
        except EntryRefusedError as err:
            self.census.refused[err.reason] += 1
            log.error(
                "registry entry refused: its worker is left out",
                extra={
                    "key": key.decode(errors="replace"),
                    "reason": err.reason.value,
                    "schema_version": err.version,
                    "error": err.detail,
                },
            )
            return None
        if endpoint.ignored_members:
            log.debug(
                "registry entry of a newer schema: members this version does not know ignored",
                extra={
                    "key": key.decode(errors="replace"),
                    "schema_version": endpoint.schema_version,
                    "ignored": list(endpoint.ignored_members),
                },
            )
        return endpoint
