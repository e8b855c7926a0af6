"""etcd users and roles of the registry: who may read and write what (least privilege), and the adapter that
applies them (``tandem etcd-auth``, run by ``tandem up`` and by the chart's set-up Job).

etcd runs with ``--client-cert-auth``: a client's certificate CN is its etcd user, so no passwords exist. Users:

| user | may |
|---|---|
| ``root`` | everything (etcd needs it to turn auth on); only the set-up step holds its certificate |
| ``tandem-operator`` | read-write every registry key (``/tandem/v1/clusters/``: endpoints, fencing deletes, the |
|   | routers' integrity reports it reads) and Mooncake's metadata (``mooncake/``: stale entries after a fence) |
| ``tandem-router`` | read one cluster's endpoints; read-write that cluster's integrity reports, nothing else |

Workers and the Mooncake Store get no user: SGLang workers never read the registry, and Mooncake's etcd client
cannot authenticate (``mooncake-common/etcd/etcd_wrapper.go``, ``NewEtcdClient``/``newStoreClientConfig``: a
``clientv3.Config`` with endpoints only, no TLS, user or password), so a Mooncake Store on etcd
(``MOONCAKE_TE_META_DATA_SERVER=etcd://...``) needs an etcd of its own (charts/tandem/README.md).

``auth_plan`` is pure; ``apply_auth`` is idempotent (re-run on every chart upgrade): it adds what is missing,
revokes permissions a role should no longer have, then turns auth on.
"""

from __future__ import annotations

import argparse
import asyncio
import logging
import sys
import time
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from enum import Enum
from typing import Any

from aetcd import rpc

from tandem import logs, registry, registry_etcd
from tandem.etcd_errors import EtcdError, as_etcd_errors
from tandem.registry import EtcdTLS

log = logging.getLogger("tandem.etcd_auth")

ROOT_USER = "root"
OPERATOR_USER = "tandem-operator"
ROUTER_USER = "tandem-router"
MOONCAKE_PREFIX = "mooncake/"


class Access(Enum):
    READ = 0  # authpb.Permission.READ
    READWRITE = 2  # authpb.Permission.READWRITE


@dataclass(frozen=True, order=True)
class Grant:
    prefix: str
    access: Access

    @property
    def range_end(self) -> bytes:
        return prefix_end(self.prefix.encode())


def prefix_end(prefix: bytes) -> bytes:
    """etcd's range end of every key starting with ``prefix`` (clientv3.GetPrefixRangeEnd)."""
    end = bytearray(prefix)
    for i in range(len(end) - 1, -1, -1):
        if end[i] < 0xFF:
            end[i] += 1
            return bytes(end[: i + 1])
    return b"\0"


def auth_plan(clusters: Sequence[tuple[str, str]]) -> dict[str, frozenset[Grant]]:
    """Role (named as its user) -> its grants, for routers serving the PD ``clusters`` ((namespace, name) pairs)."""
    router = frozenset(
        grant
        for namespace, name in clusters
        for grant in (
            Grant(registry.cluster_prefix(namespace, name), Access.READ),
            Grant(registry.integrity_prefix(namespace, name), Access.READWRITE),
        )
    )
    operator = frozenset({Grant(registry.ROOT + "/", Access.READWRITE), Grant(MOONCAKE_PREFIX, Access.READWRITE)})
    return {OPERATOR_USER: operator, ROUTER_USER: router}


async def setup_auth(endpoints: Sequence[str], root: EtcdTLS, clusters: Sequence[tuple[str, str]]) -> None:
    """``apply_auth(auth_plan(clusters))`` as ``root`` (a client certificate with CN ``root``); raises
    ``EtcdError`` when etcd does not answer or refuses (``apply_auth`` calls etcd's Auth service directly)."""
    etcd = registry_etcd.client(endpoints, tls=root)
    await etcd.connect()
    try:
        with as_etcd_errors("auth set-up", etcd.endpoint):
            await apply_auth(etcd, auth_plan(clusters))
    finally:
        await etcd.close()


async def apply_auth(etcd: Any, plan: Mapping[str, frozenset[Grant]]) -> None:
    """Make ``etcd``'s users and roles equal ``plan`` and turn auth on. ``etcd``: a connected client whose
    certificate is ``root``'s once auth is on (before, any client may set it up)."""
    stub = rpc.AuthStub(etcd.channel)
    users = set((await stub.UserList(rpc.AuthUserListRequest())).users)
    roles = set((await stub.RoleList(rpc.AuthRoleListRequest())).roles)
    if ROOT_USER not in users:
        await stub.UserAdd(rpc.AuthUserAddRequest(name=ROOT_USER, options=rpc.UserAddOptions(no_password=True)))
    await stub.UserGrantRole(rpc.AuthUserGrantRoleRequest(user=ROOT_USER, role="root"))
    for name, grants in plan.items():
        if name not in roles:
            await stub.RoleAdd(rpc.AuthRoleAddRequest(name=name))
        current = {
            (bytes(p.key), bytes(p.range_end), int(p.permType))
            for p in (await stub.RoleGet(rpc.AuthRoleGetRequest(role=name))).perm
        }
        wanted = {(g.prefix.encode(), g.range_end, g.access.value) for g in grants}
        for key, end, _ in current - wanted:
            await stub.RoleRevokePermission(rpc.AuthRoleRevokePermissionRequest(role=name, key=key, range_end=end))
        for key, end, perm in sorted(wanted - current):
            permission = rpc.Permission(permType=perm, key=key, range_end=end)
            await stub.RoleGrantPermission(rpc.AuthRoleGrantPermissionRequest(name=name, perm=permission))
        if name not in users:
            await stub.UserAdd(rpc.AuthUserAddRequest(name=name, options=rpc.UserAddOptions(no_password=True)))
        await stub.UserGrantRole(rpc.AuthUserGrantRoleRequest(user=name, role=name))
    await stub.AuthEnable(rpc.AuthEnableRequest())
    log.info("etcd auth applied", extra={"roles": {n: sorted(g.prefix for g in gs) for n, gs in plan.items()}})


def _cluster(value: str) -> tuple[str, str]:
    namespace, _, name = value.partition("/")
    if not namespace or not name:
        raise argparse.ArgumentTypeError(f"--cluster takes NAMESPACE/NAME, got {value!r}")
    return namespace, name


def main(argv: Sequence[str]) -> int:
    """``tandem etcd-auth``: create the registry's users and roles and turn etcd's auth on (idempotent)."""
    p = argparse.ArgumentParser(prog="tandem etcd-auth", description=__doc__.split("\n\n")[0])
    p.add_argument("--etcd-endpoint", dest="endpoints", action="append", required=True, metavar="HOST:PORT")
    p.add_argument("--ca-file", required=True, help="CA of etcd's server certificates")
    p.add_argument("--cert-file", required=True, help="client certificate with CN 'root'")
    p.add_argument("--key-file", required=True)
    p.add_argument("--server-name", help="name etcd's certificate is checked against (default: the endpoint's host)")
    p.add_argument("--cluster", action="append", type=_cluster, default=[], metavar="NAMESPACE/NAME",
                   help="a PD cluster whose routers get a role (repeatable)")  # fmt: skip
    p.add_argument("--wait-s", type=float, default=300.0, help="keep trying this long while etcd is not up")
    args = p.parse_args(list(argv))
    logs.setup("info", "tandem.etcd_auth")
    tls = EtcdTLS(ca_file=args.ca_file, cert_file=args.cert_file, key_file=args.key_file, server_name=args.server_name)

    async def run() -> int:
        deadline = time.monotonic() + args.wait_s
        while True:
            try:
                await setup_auth(args.endpoints, tls, args.cluster)
                return 0
            except EtcdError as err:  # etcd not up yet (a fresh StatefulSet): retry until the deadline
                if time.monotonic() > deadline:
                    print(f"tandem etcd-auth: giving up after {args.wait_s:.0f}s: {err!r}", file=sys.stderr)
                    return 1
                log.warning("etcd not ready for auth set-up; retrying", extra={"error": repr(err)})
                await asyncio.sleep(2)

    return asyncio.run(run())
