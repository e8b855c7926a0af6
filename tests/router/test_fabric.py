"""Fabric locality: pairs within one RDMA fabric domain first (preferred) or only (required), from the registry's
fabric fields or ``--fabric-locality``; the choice metric and the 503 of a request with no pair within a domain."""

from __future__ import annotations

from collections import Counter

import orjson
import pytest
from prometheus_client import generate_latest

from tandem.registry import Endpoint, FabricMode, Role
from tandem_router.config import load
from tandem_router.discovery_etcd import endpoint_spec
from tandem_router.metrics import RouterMetrics
from tandem_router.policy import breaker as br
from tandem_router.policy import selection as sel
from tandem_router.policy.fabric import FabricLocality, Locality, Tier, pair_tier
from tandem_router.pool import WorkerPool, WorkerSpec
from tests.router.helpers import stack

AUTO, PREFERRED, REQUIRED, OFF = (FabricLocality(v) for v in ("auto", "preferred", "required", "off"))


@pytest.mark.parametrize(
    ("setting", "prefill", "decode", "required", "tier"),
    [
        (AUTO, "a", "a", False, Tier.SAME),
        (AUTO, "a", "b", False, Tier.CROSS),
        (AUTO, "a", None, False, Tier.SAME),  # unknown: compatible with every domain
        (AUTO, None, None, False, Tier.SAME),
        (AUTO, "a", "a", True, Tier.SAME),
        (AUTO, "a", "b", True, None),
        (AUTO, "a", None, True, None),  # required: an unknown domain is not the same domain
        (PREFERRED, "a", "b", True, Tier.CROSS),  # the flag overrides the registry's mode
        (PREFERRED, None, "b", False, Tier.SAME),
        (REQUIRED, "a", "b", False, None),
        (REQUIRED, None, None, False, None),
        (REQUIRED, "a", "a", False, Tier.SAME),
        (OFF, "a", "b", True, Tier.SAME),
        (OFF, None, "b", True, Tier.SAME),
    ],
)
def test_pair_tier(
    setting: FabricLocality, prefill: str | None, decode: str | None, required: bool, tier: Tier | None
) -> None:
    assert pair_tier(setting, prefill, decode, decode_required=required) == tier
    assert pair_tier(setting, prefill, decode, prefill_required=required) == tier


def _spec(role: Role, n: int, domain: str | None, required: bool = False) -> WorkerSpec:
    url = f"http://{role.value[0]}{n}:1"
    return WorkerSpec(role, url, 8998 if role is Role.PREFILL else None, fabric_domain=domain, fabric_required=required)


def _pool(
    domains: dict[str, str | None],
    fabric: FabricLocality = AUTO,
    required: bool = False,
    policy: sel.Policy = sel.Policy.CACHE_AWARE,
) -> WorkerPool:
    """Workers named ``p<n>`` / ``d<n>`` with their domains (``required``: what every registry entry says)."""
    pool = WorkerPool(policy, br.BreakerConfig(threshold=1, cooldown=10), fabric=fabric)
    pool.replace_all(
        _spec(Role.PREFILL if name[0] == "p" else Role.DECODE, int(name[1:]), domain, required)
        for name, domain in domains.items()
    )
    return pool


def _chosen(pool: WorkerPool, requests: int = 40, now: float = 0.0) -> Counter[tuple[str, str]]:
    chosen: Counter[tuple[str, str]] = Counter()
    for i in range(requests):
        pair = pool.choose_pair(f"{i}: a new conversation", now)
        if pair is not None:
            chosen[(pair.prefill.url[7:9], pair.decode.url[7:9])] += 1
    return chosen


@pytest.mark.parametrize("policy", list(sel.Policy))
def test_preferred_chooses_same_domain_pairs_while_one_is_healthy(policy: sel.Policy) -> None:
    pool = _pool({"p0": "a", "p1": "b", "d0": "a", "d1": "b", "d2": "c"}, policy=policy)
    chosen = _chosen(pool)
    assert set(chosen) == {("p0", "d0"), ("p1", "d1")}, chosen  # never d2, whose domain has no prefill
    assert pool.fabric_choices == {Locality.SAME: 40, Locality.CROSS: 0, Locality.UNKNOWN: 0}
    d0, d1 = pool.workers["decode:http://d0:1"].spec, pool.workers["decode:http://d1:1"].spec
    pool.record_worker(d0, False, 0.0, hard=True)  # a's decode is down: p1 -> d1 is the only same-domain pair
    assert set(_chosen(pool, 20)) == {("p1", "d1")}
    pool.record_worker(d1, False, 0.0, hard=True)  # no same-domain pair left: across domains rather than not at all
    chosen = _chosen(pool, 20)
    assert {d for _, d in chosen} == {"d2"}
    assert sum(chosen.values()) == 20
    assert pool.fabric_choices[Locality.CROSS] == 20


def test_preferred_takes_a_cross_domain_pair_when_the_same_domain_pair_is_gated_or_excluded() -> None:
    pool = _pool({"p0": "a", "d0": "a", "d1": "b"})
    same = ("prefill:http://p0:1", "decode:http://d0:1")
    assert {pool.choose_pair("x", 0.0).key for _ in range(5)} == {same}  # type: ignore[union-attr]
    pair = pool.choose_pair("x", 0.0, exclude=frozenset({same}))  # the request failed on it: retry elsewhere
    assert pair is not None
    assert pair.decode.fabric_domain == "b"


def test_unknown_domains_pair_with_anything_when_preferred() -> None:
    pool = _pool({"p0": "a", "p1": None, "d0": "b", "d1": None})
    chosen = _chosen(pool)
    assert ("p0", "d0") not in chosen  # a known cross-domain pair loses to pairs with an unknown side
    assert set(chosen) <= {("p0", "d1"), ("p1", "d0"), ("p1", "d1")}
    assert pool.fabric_choices[Locality.UNKNOWN] == 40


@pytest.mark.parametrize(("fabric", "required"), [(AUTO, True), (REQUIRED, False)])
def test_required_forms_no_pair_across_domains(fabric: FabricLocality, required: bool) -> None:
    pool = _pool({"p0": "a", "p1": None, "d0": "a", "d1": "b"}, fabric=fabric, required=required)
    assert set(_chosen(pool)) == {("p0", "d0")}
    assert [p.key for p in pool.all_pairs()] == [("prefill:http://p0:1", "decode:http://d0:1")]  # canaries too
    assert not pool.fabric_refuses(0.0)
    pool.record_worker(pool.workers["decode:http://d0:1"].spec, False, 0.0, hard=True)
    assert pool.choose_pair("x", 0.0) is None
    assert not pool.has_healthy_pair(0.0)  # /readiness: no pair it may choose
    assert pool.fabric_refuses(0.0)  # healthy pairs exist, only across domains
    assert pool.fabric_choices == {Locality.SAME: 40, Locality.CROSS: 0, Locality.UNKNOWN: 0}


def test_no_fabric_refusal_when_nothing_healthy_is_left_either() -> None:
    pool = _pool({"p0": "a", "d0": "b"}, fabric=REQUIRED)
    assert pool.fabric_refuses(0.0)
    pool.record_worker(pool.workers["prefill:http://p0:1"].spec, False, 0.0, hard=True)
    assert not pool.fabric_refuses(0.0)  # no pair at all: the plain "no healthy pair" answer


def test_off_ignores_domains() -> None:
    pool = _pool({"p0": "a", "d0": "a", "d1": "b"}, fabric=OFF, required=True, policy=sel.Policy.ROUND_ROBIN)
    assert _chosen(pool, 10) == Counter({("p0", "d0"): 5, ("p0", "d1"): 5})
    assert pool.fabric_choices == {Locality.SAME: 5, Locality.CROSS: 5, Locality.UNKNOWN: 0}  # still counted


def test_metrics_count_choices_by_locality_and_pairs_the_mode_allows() -> None:
    pool = _pool({"p0": "a", "d0": "a", "d1": "b"}, fabric=REQUIRED)
    metrics = RouterMetrics(pool)
    pool.choose_pair("x", 0.0)
    text = generate_latest(metrics.registry).decode()
    assert 'tandem_router_fabric_pair_choices_total{locality="same"} 1.0' in text
    assert 'tandem_router_fabric_pair_choices_total{locality="cross"} 0.0' in text
    assert 'tandem_router_fabric_pair_choices_total{locality="unknown"} 0.0' in text
    assert 'tandem_router_pairs{revision=""} 1.0' in text  # p0 -> d1 crosses domains: not a pair


def test_registry_entries_carry_domain_and_mode_to_the_worker() -> None:
    base = {"role": Role.DECODE, "group": "decode-0", "url": "http://10.0.0.1:30001", "model": "m"}
    spec = endpoint_spec(Endpoint(**base, fabric_domain="rack-7", fabric_mode=FabricMode.REQUIRED))  # type: ignore[arg-type]
    assert (spec.fabric_domain, spec.fabric_required) == ("rack-7", True)
    spec = endpoint_spec(Endpoint(**base, fabric_domain="rack-7", fabric_mode=FabricMode.PREFERRED))  # type: ignore[arg-type]
    assert (spec.fabric_domain, spec.fabric_required) == ("rack-7", False)
    spec = endpoint_spec(Endpoint(**base))  # type: ignore[arg-type]
    assert (spec.fabric_domain, spec.fabric_required) == (None, False)


def test_fabric_locality_flag() -> None:
    assert load([]).fabric_locality is AUTO
    assert load(["--fabric-locality", "required"]).fabric_locality is REQUIRED
    with pytest.raises(SystemExit):
        load(["--fabric-locality", "sometimes"])


CHAT = {"model": "instant-model", "messages": [{"role": "user", "content": "hello"}]}


async def test_a_request_with_no_same_domain_pair_gets_an_openai_503_when_required() -> None:
    async with stack(1, 2, fabric_locality=REQUIRED) as s:
        pool = s.state.pool
        p, d0, d1 = (w.spec for w in (*pool.of_role(Role.PREFILL), *pool.of_role(Role.DECODE)))
        pool.replace_all(
            [
                WorkerSpec(Role.PREFILL, p.url, p.bootstrap_port, fabric_domain="rack-a"),
                WorkerSpec(Role.DECODE, d0.url, fabric_domain="rack-b"),
                WorkerSpec(Role.DECODE, d1.url, fabric_domain="rack-c"),
            ]
        )
        status, raw = await s.post("/v1/chat/completions", CHAT)
        assert status == 503
        error = orjson.loads(raw)["error"]
        assert error["code"] == "no_fabric_local_pair"
        assert error["type"] == "service_unavailable"  # ErrorType.UNAVAILABLE
        assert "fabric" in error["message"]
        assert await s.received(s.decodes[0]) == await s.received(s.decodes[1]) == []
        async with s.http.get(f"{s.router.url}/metrics") as resp:
            text = await resp.text()
        assert 'tandem_router_fabric_refused_requests_total{route="/v1/chat/completions"} 1.0' in text
        async with s.http.get(f"{s.router.url}/readiness") as resp:
            assert resp.status == 503
        pool.upsert(WorkerSpec(Role.DECODE, d1.url, fabric_domain="rack-a"))  # a decode in the prefill's rack
        status, _ = await s.post("/v1/chat/completions", CHAT)
        assert status == 200
        assert len(await s.received(s.decodes[1])) == 1
        assert pool.fabric_choices[Locality.SAME] == 1
