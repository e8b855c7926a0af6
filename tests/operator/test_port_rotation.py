"""Each incarnation (epoch) of a group gets the next Mooncake port window of the declared range, so a recreated pod
never comes back under a session id ``ip:port`` that peers still hold for the dead one, and a prefill the next port of
its bootstrap range, so decodes never hand rooms to the dead one's cached rank ports (operator/README.md)."""

from __future__ import annotations

import itertools
from typing import Any

import pytest
from pydantic import ValidationError

from tandem.registry import Role
from tandem_operator.decide.registration import leader_endpoint
from tandem_operator.desired.naming import ANNOTATION_BOOTSTRAP_PORT as ANNOTATION
from tandem_operator.desired.pods import RoleContext, group_manifests, group_pod, mooncake_ports, rotate_window
from tests.operator.conftest import kimi_spec
from tests.operator.workers import CLUSTER, POOL, live_pod


def env_of(pod: dict[str, Any]) -> dict[str, str]:
    return {v["name"]: v["value"] for v in pod["spec"]["containers"][0]["env"] if "value" in v}


@pytest.mark.parametrize(
    ("window", "declared", "epochs", "expected"),
    [
        ((15000, 15001), 16, range(10), [(15000 + 2 * i, 15001 + 2 * i) for i in range(8)] + [(15000, 15001)] * 1),
        ((15000, 15000), 4, range(6), [(15000,) * 2, (15001,) * 2, (15002,) * 2, (15003,) * 2, (15000,) * 2]),
        ((15000, 15001), 2, range(3), [(15000, 15001)] * 3),  # one window: the range is too small to rotate
        ((15000, 15015), 40, range(4), [(15000, 15015), (15016, 15031), (15000, 15015), (15016, 15031)]),
    ],
)
def test_windows_rotate_by_epoch_and_wrap(
    window: tuple[int, int], declared: int, epochs: range, expected: list[tuple[int, int]]
) -> None:
    got = [rotate_window(window, declared, epoch) for epoch in epochs]
    assert got[: len(expected)] == expected


def test_consecutive_epochs_never_share_a_port_and_stay_in_the_range() -> None:
    for size in (1, 2, 3, 16):
        for declared in range(2 * size, 70):
            low = 20000
            seen = [rotate_window((low, low + size - 1), declared, epoch) for epoch in range(50)]
            for (a_low, a_high), (b_low, b_high) in itertools.pairwise(seen):
                assert a_high < b_low or b_high < a_low
            assert all(low <= w_low and w_high < low + declared for w_low, w_high in seen)


@pytest.mark.parametrize("host_network", [False, True])
def test_a_recreated_pod_gets_the_next_window(host_network: bool) -> None:
    # tcp, 8 ranks per pod, decode KV offload: two engines per rank (PD and Store: the Store reuses the PD engine
    # only over rdma), 32-port windows, 2 of them in decode's 64-port range from 15100
    spec = kimi_spec(transfer={"protocol": "tcp", "hostNetwork": host_network})
    ctx = RoleContext.build(CLUSTER, spec, Role.DECODE, POOL)
    first, second = (group_pod(ctx, 0, 0, epoch) for epoch in (4, 5))
    assert (env_of(first)["MC_MIN_RPC_PORT"], env_of(first)["MC_MAX_RPC_PORT"]) == ("15100", "15131")  # wrapped
    assert (env_of(second)["MC_MIN_RPC_PORT"], env_of(second)["MC_MAX_RPC_PORT"]) == ("15132", "15163")
    declared = [p for p in second["spec"]["containers"][0]["ports"] if p["name"].startswith("mooncake-")]
    assert [p["containerPort"] for p in declared] == list(range(15132, 15164))
    if host_network:  # node ports: the scheduler keeps a pod off a node whose window another pod holds
        assert all(p["hostPort"] == p["containerPort"] for p in declared)


def test_every_rank_of_an_incarnation_shares_its_window() -> None:
    ctx = RoleContext.build(CLUSTER, kimi_spec(transfer={"protocol": "tcp"}), Role.PREFILL, POOL)
    envs = [env_of(group_pod(ctx, 0, rank, 3)) for rank in range(4)]
    assert {(e["MC_MIN_RPC_PORT"], e["MC_MAX_RPC_PORT"]) for e in envs} == {("15048", "15063")}
    assert mooncake_ports(ctx, 3) == (15048, 15063)


def test_probe_and_refresh_knobs_reach_the_pod() -> None:
    spec = kimi_spec(transfer={"protocol": "tcp", "metadataRefreshSeconds": 3, "failedSessionProbeSeconds": 2})
    env = env_of(group_pod(RoleContext.build(CLUSTER, spec, Role.PREFILL, POOL), 0, 0))
    assert env["MC_TE_METADATA_REFRESH_INTERVAL_SECONDS"] == "3"
    assert env["SGLANG_FAILED_SESSION_PROBE_INTERVAL_S"] == "2"
    assert env["SGLANG_FAILED_SESSION_PROBE_MAX_INTERVAL_S"] == "4"


DECODE_PORTS = {"http": 30001, "bootstrap": 8999, "distInit": 5001}


@pytest.mark.parametrize(
    ("overrides", "message"),
    [
        (
            {
                "transfer": {"protocol": "tcp"},
                "decode": {"ports": {**DECODE_PORTS, "mooncakeRpc": 4000, "mooncakePorts": 1}},
            },
            "decode.ports.mooncakePorts must hold one pod's window",
        ),
        ({"decode": {"ports": {**DECODE_PORTS, "http": 15105, "mooncakeRpc": 15100}}}, "outside the Mooncake range"),
        ({"decode": {"ports": {**DECODE_PORTS, "mooncakeRpc": 65530}}}, "must lie within 1024-32767 or 61000-65535"),
        ({"decode": {"ports": {**DECODE_PORTS, "mooncakeRpc": 32760}}}, "touches the ephemeral ports"),
        ({"decode": {"ports": {**DECODE_PORTS, "mooncakeRpc": 1000}}}, "must lie within 1024-32767"),
        (
            {
                "transfer": {"protocol": "tcp", "hostNetwork": True},
                "decode": {"ports": {**DECODE_PORTS, "mooncakeRpc": 15010}},
            },
            "must not share a port",
        ),
        ({"transfer": {"protocol": "tcp", "failedSessionProbeSeconds": 9}}, "must not exceed"),
    ],
)
def test_invalid_ranges_are_rejected_with_a_message_naming_the_field(overrides: dict[str, Any], message: str) -> None:
    with pytest.raises(ValidationError, match=message):
        kimi_spec(**overrides)


def bootstrap_of(pod: dict[str, Any]) -> tuple[int, int, str]:
    """The pod's ``--disaggregation-bootstrap-port``, its container port named bootstrap, its annotation."""
    container = pod["spec"]["containers"][0]
    argv = container.get("command", []) + container["args"]
    flag = int(argv[argv.index("--disaggregation-bootstrap-port") + 1])
    (declared,) = [p["containerPort"] for p in container["ports"] if p["name"] == "bootstrap"]
    return flag, declared, pod["metadata"]["annotations"]["sglang.ai/bootstrap-port"]


@pytest.mark.parametrize("host_network", [False, True])
def test_a_recreated_prefill_serves_bootstrap_on_the_next_port_of_its_range(host_network: bool) -> None:
    """Decodes cache a bootstrap address's rank ports until two heartbeats to it fail; a recreated prefill answers
    them within seconds, so it must not come back under the dead incarnation's address (PortSet.bootstrap_at)."""
    spec = kimi_spec(transfer={"protocol": "tcp", "hostNetwork": host_network})
    ctx = RoleContext.build(CLUSTER, spec, Role.PREFILL, POOL)
    got = [bootstrap_of(group_pod(ctx, 0, 0, epoch)) for epoch in range(10)]
    ports = [8998 + epoch % 8 for epoch in range(10)]  # the default range: 8 ports from 8998, wrapping
    assert got == [(port, port, str(port)) for port in ports]
    service = group_manifests(ctx, 0, 3)[0]
    assert {"name": "bootstrap", "port": 8998, "targetPort": "bootstrap"} in service["spec"]["ports"]


def test_a_range_of_one_port_keeps_the_address() -> None:
    spec = kimi_spec(prefill={"ports": {**PREFILL_PORTS, "bootstrapPorts": 1}})
    ctx = RoleContext.build(CLUSTER, spec, Role.PREFILL, POOL)
    assert {bootstrap_of(group_pod(ctx, 0, 0, epoch))[0] for epoch in range(5)} == {8998}


def test_the_registered_bootstrap_port_is_the_epochs() -> None:
    spec = kimi_spec()
    for epoch in (0, 1, 9):
        leader = live_pod(spec, Role.PREFILL, 0, 0, epoch=epoch, ip="10.0.2.1")
        endpoint = leader_endpoint(spec, Role.PREFILL, leader)
        assert endpoint is not None
        assert endpoint.bootstrap_port == 8998 + epoch % 8 == int(leader["metadata"]["annotations"][ANNOTATION])


PREFILL_PORTS = {"http": 30000, "bootstrap": 8998, "distInit": 5000, "mooncakeRpc": 15000}


@pytest.mark.parametrize(
    ("overrides", "message"),
    [
        ({"prefill": {"ports": {**PREFILL_PORTS, "http": 9001}}}, "outside the bootstrap range"),
        ({"prefill": {"ports": {**PREFILL_PORTS, "mooncakeRpc": 9000, "mooncakePorts": 32}}}, "outside the boot"),
        ({"prefill": {"ports": {**PREFILL_PORTS, "bootstrap": 15005, "bootstrapPorts": 2}}}, "outside the Mooncake"),
        ({"prefill": {"ports": {**PREFILL_PORTS, "bootstrapPorts": 65}}}, "less than or equal to 64"),
        (
            {  # decode's http inside prefill's bootstrap range [8998, 9005]
                "transfer": {"protocol": "tcp", "hostNetwork": True},
                "decode": {"ports": {**DECODE_PORTS, "http": 9003, "bootstrap": 9100, "mooncakeRpc": 15100}},
            },
            "must not share a port",
        ),
    ],
)
def test_bootstrap_ranges_that_clash_are_rejected_naming_the_field(overrides: dict[str, Any], message: str) -> None:
    with pytest.raises(ValidationError, match=message):
        kimi_spec(**overrides)
