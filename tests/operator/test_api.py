"""PDCluster / PDPool models: Kimi K2.6 defaults and the cross-field rules (the same messages CEL reports)."""

from __future__ import annotations

import re
from typing import Any, get_args

import pytest
from pydantic import ValidationError

from tandem.registry import Role
from tandem_operator.api.pdcluster import DeepEPMode, PDClusterSpec, RouterSpec, TransferProtocol
from tandem_operator.api.pdpool import PDPoolSpec
from tandem_router.policy.selection import Policy

BASE: dict[str, Any] = {"transfer": {"protocol": "tcp"}, "etcd": {"endpoints": ["http://etcd:2379"]}}


def spec(**overrides: Any) -> PDClusterSpec:
    return PDClusterSpec.model_validate({**BASE, **overrides})


def test_kimi_defaults() -> None:
    s = spec()
    assert (s.model.path, s.model.served_name, s.model.trust_remote_code) == ("moonshotai/Kimi-K2.6", "kimi-k2.6", True)
    assert (s.model.tool_call_parser, s.model.reasoning_parser) == ("kimi_k2", "kimi_k2")
    assert (s.prefill.deepep_mode, s.decode.deepep_mode) == (DeepEPMode.NORMAL, DeepEPMode.LOW_LATENCY)
    assert (s.prefill.tp_size, s.prefill.ep_size, s.prefill.gpus_per_node) == (8, 8, 8)
    assert s.decode.kv_offload.enabled is False
    assert s.role_ports(Role.PREFILL).isdisjoint(s.role_ports(Role.DECODE))
    assert s.transfer.protocol is TransferProtocol.TCP


def test_wire_form_is_camel_case_and_round_trips() -> None:
    s = spec(decode={"nodesPerGroup": 2, "tpSize": 16, "epSize": 16, "attnDpSize": 16, "enableDpLmHead": True})
    wire = s.to_wire()
    assert wire["decode"]["nodesPerGroup"] == 2
    assert wire["decode"]["kvOffload"] == {"enabled": False, "hostMemoryGib": 64}
    assert "revision" not in wire["model"]
    assert PDClusterSpec.model_validate(wire) == s


@pytest.mark.parametrize(
    ("overrides", "message"),
    [
        ({"prefill": {"nodesPerGroup": 2}}, "tpSize must equal nodesPerGroup * gpusPerNode"),
        (
            {"decode": {"tpSize": 8, "epSize": 3, "moeA2ABackend": "none"}},
            "epSize must divide tpSize",
        ),
        ({"decode": {"attnDpSize": 3}}, "attnDpSize must divide tpSize"),
        ({"decode": {"epSize": 4, "moeA2ABackend": "deepep"}}, "moeA2ABackend deepep needs epSize == tpSize"),
        ({"prefill": {"enableDpLmHead": True}}, "enableDpLmHead needs attnDpSize > 1"),
        ({"prefill": {"extraArgs": ["--tp-size=4"]}}, "extraArgs may not set flags the operator manages"),
        ({"prefill": {"extraArgs": ["--host", "0.0.0.0"]}}, "extraArgs may not set flags the operator manages"),
        ({"transfer": {"protocol": "tcp", "ibDevices": ["mlx5_0"]}}, "ibDevices needs protocol rdma"),
        ({"decode": {"kvOffload": {"enabled": True}}}, "kvOffload.enabled needs a storageBackend"),
        (
            {"decode": {"kvOffload": {"enabled": True, "storageBackend": "mooncake"}}},
            "storageBackend mooncake needs mooncakeStore",
        ),
        (
            {"decode": {"kvOffload": {"storageBackend": "mooncake", "mooncakeStore": {"masterHa": False}}}},
            "mooncakeStore needs masterHa: true or a masterAddress",
        ),
        (
            {"decode": {"ports": {"http": 1, "bootstrap": 1, "distInit": 2, "mooncakeRpc": 3}}},
            "ports must be pairwise different",
        ),
        (
            {
                "transfer": {"protocol": "tcp", "hostNetwork": True},
                "decode": {"ports": {"http": 30000, "bootstrap": 2, "distInit": 30, "mooncakeRpc": 20000}},
            },
            "with transfer.hostNetwork, prefill.ports and decode.ports (Mooncake ranges included) must not share",
        ),
        (
            {  # prefill's range is [15000, 15015] with tcp and 8 GPUs per pod: 15010 is inside it
                "transfer": {"protocol": "tcp", "hostNetwork": True},
                "decode": {"ports": {"http": 30001, "bootstrap": 8999, "distInit": 5001, "mooncakeRpc": 15010}},
            },
            "with transfer.hostNetwork, prefill.ports and decode.ports (Mooncake ranges included) must not share",
        ),
        (
            {
                "transfer": {"protocol": "tcp"},
                "decode": {"ports": {"mooncakeRpc": 32760, "http": 1, "bootstrap": 2, "distInit": 30}},
            },
            "decode.ports: the Mooncake range [mooncakeRpc, mooncakeRpc + mooncakePorts - 1] "
            "must lie within 1024-32767 or 61000-65535",
        ),
        (
            {"prefill": {"ports": {"http": 15003, "bootstrap": 8998, "distInit": 5000, "mooncakeRpc": 15000}}},
            "prefill.ports: http, the bootstrap range and distInit must lie outside the Mooncake range",
        ),
        ({"etcd": {"endpoints": []}}, "at least 1 item"),
        ({"prefill": {"gpusPerNode": 0}}, "greater than or equal to 1"),
        ({"prefill": {"deepepMode": "fast"}}, "'normal', 'low_latency' or 'auto'"),
        ({"prefill": {"unknownField": 1}}, "Extra inputs are not permitted"),
    ],
)
def test_invalid_specs_are_rejected_with_the_rule_message(overrides: dict[str, Any], message: str) -> None:
    with pytest.raises(ValidationError, match=re.escape(message)):
        spec(**overrides)


def test_valid_edge_cases() -> None:
    spec(transfer={"protocol": "rdma", "ibDevices": ["mlx5_0", "mlx5_1"]})
    spec(transfer={"protocol": "rdma"})  # no ibDevices: the worker finds the devices with an ACTIVE port
    spec(transfer={"protocol": "tcp", "hostNetwork": True})
    spec(prefill={"extraArgs": ["--chunked-prefill-size", "524288", "--enable-metrics-for-all-schedulers"]})
    spec(decode={"kvOffload": {"enabled": True, "storageBackend": "mooncake", "mooncakeStore": {}}})
    spec(decode={"moeA2ABackend": "none", "epSize": 1})


def test_pdpool_spec() -> None:
    pool = PDPoolSpec.model_validate({"clusterName": "kimi", "role": "decode", "replicas": 3})
    assert (pool.role, pool.replicas) == (Role.DECODE, 3)
    with pytest.raises(ValidationError, match="greater than or equal to 0"):
        PDPoolSpec.model_validate({"clusterName": "kimi", "role": "decode", "replicas": -1})


def test_router_policies_are_the_routers_own() -> None:
    field = RouterSpec.model_fields["policy"]
    assert set(get_args(field.annotation)) == {p.value for p in Policy}
    assert RouterSpec().policy == Policy.CACHE_AWARE.value
