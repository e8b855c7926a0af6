"""Flow control's adapter and the tenant identity: 429s with Retry-After, queue deadlines, limits reloaded from a
file (a malformed one refused, the last good one kept), metrics, and who a tenant is."""

from __future__ import annotations

import asyncio
import os
import subprocess
import sys
import time
from pathlib import Path

import orjson
import pytest
from prometheus_client import CollectorRegistry, generate_latest

from tandem.registry import Role
from tandem_router.config import RouterSettings
from tandem_router.flow.fair import Pending
from tandem_router.flow_control import FlowControl
from tandem_router.policy.load import WorkerLoad
from tandem_router.pool import WorkerPool, WorkerSpec
from tandem_router.server import Reply, ServerRequest
from tandem_router.tenants import client_identity, key_identity


def _flow(tmp_path: Path, text: str | None = None, **settings: object) -> tuple[FlowControl, CollectorRegistry]:
    path = None
    if text is not None:
        path = tmp_path / "limits.yaml"
        path.write_text(text)
    registry = CollectorRegistry()
    return FlowControl(
        RouterSettings.model_validate({"flow_limits_file": path, **settings}), WorkerPool(), registry
    ), registry


def _metric(registry: CollectorRegistry, line: str) -> bool:
    return line in generate_latest(registry).decode()


async def test_over_a_limit_is_an_openai_429_with_retry_after(tmp_path: Path) -> None:
    flow, registry = _flow(tmp_path, "tenants: {'peer:1.2.3.4': {requests_per_minute: 1}}")
    assert isinstance(await flow.enter("peer:1.2.3.4", None, 1), Pending)
    refused = await flow.enter("peer:1.2.3.4", None, 1)
    assert isinstance(refused, Reply)
    assert refused.status == 429
    assert dict(refused.headers)["Retry-After"] == "60"
    error = orjson.loads(refused.body)["error"]
    assert (error["type"], error["code"]) == ("rate_limit_exceeded", "requests_per_minute")
    assert _metric(
        registry, 'tandem_router_flow_rejected_requests_total{reason="requests_per_minute",tenant="peer:1.2.3.4"} 1.0'
    )


async def test_a_queued_request_waits_for_a_slot_or_its_deadline(tmp_path: Path) -> None:
    flow, registry = _flow(tmp_path, "default: {queue_timeout_s: 0.2}", flow_headroom_share=0, flow_reserve_share=0)
    flow.core.set_capacity(1)
    first = await flow.enter("a", None, 1)
    assert isinstance(first, Pending)
    waiter = asyncio.create_task(flow.enter("b", 3, 1))
    await asyncio.sleep(0.05)
    assert _metric(registry, 'tandem_router_flow_queued_requests{priority="0"} 1.0')  # b may not raise it
    flow.leave(first)
    second = await waiter
    assert isinstance(second, Pending)
    assert second.admitted
    late = await flow.enter("c", None, 1)  # the slot is b's until it leaves: c waits 0.2 s, then 429
    assert isinstance(late, Reply)
    assert late.status == 429
    assert b"queue_timeout" in late.body
    flow.leave(second)
    assert flow.core.in_flight == flow.core.queued == 0


async def test_a_client_that_leaves_while_queued_gives_its_place_up(tmp_path: Path) -> None:
    flow, _ = _flow(tmp_path, flow_headroom_share=0, flow_reserve_share=0)
    flow.core.set_capacity(1)
    first = await flow.enter("a", None, 1)
    waiter = asyncio.create_task(flow.enter("b", None, 1))
    await asyncio.sleep(0.01)
    waiter.cancel()
    with pytest.raises(asyncio.CancelledError):
        await waiter
    assert flow.core.queued == 0
    assert isinstance(first, Pending)
    flow.leave(first)
    assert flow.core.in_flight == 0


async def test_capacity_is_learned_from_the_pool_decodes(tmp_path: Path) -> None:
    flow, registry = _flow(tmp_path)
    for n in range(2):
        flow.pool.upsert(WorkerSpec(Role.DECODE, f"http://d{n}:1"))
        flow.pool.workers[f"decode:http://d{n}:1"].load = WorkerLoad(running=8, queued=3)
    flow.tick(0.0)
    assert flow.core.capacity == 16
    assert _metric(registry, "tandem_router_flow_capacity_requests 16.0")


async def test_a_tenant_that_left_keeps_its_share_until_a_tick_after_the_linger(tmp_path: Path) -> None:
    flow, _ = _flow(tmp_path, flow_share_linger_s=0.5)
    slot = await flow.enter("quiet", None, 1)
    assert isinstance(slot, Pending)
    flow.leave(slot)
    assert "quiet" in flow.core._busy  # idle, still counted
    flow.tick(time.monotonic() + 0.6)
    assert not flow.core._busy
    assert flow.core._busy_weight == 0


async def test_the_limits_file_is_reloaded_and_a_bad_one_refused(tmp_path: Path) -> None:
    flow, registry = _flow(tmp_path, "default: {max_concurrency: 5}")
    path = tmp_path / "limits.yaml"
    assert flow.core.limits_of("x").max_concurrency == 5
    # A ConfigMap update: the file is a symlink whose target is swapped.
    target = tmp_path / "v2.yaml"
    target.write_text("default: {max_concurrency: 1}")
    os.replace(path, tmp_path / "old.yaml")
    path.symlink_to(target)
    flow.tick(1.0)
    assert flow.core.limits_of("x").max_concurrency == 1
    target.write_text("default: {max_concurrency: 0}\n# longer: another size")
    flow.tick(2.0)
    assert flow.core.limits_of("x").max_concurrency == 1  # the last good limits stay
    assert _metric(registry, 'tandem_router_flow_limits_reloads_total{result="refused"} 1.0')
    assert _metric(registry, 'tandem_router_flow_limits_reloads_total{result="ok"} 1.0')


async def test_tenant_series_are_bounded(tmp_path: Path) -> None:
    flow, registry = _flow(tmp_path, flow_metrics_tenants=2)
    for n in range(5):
        p = await flow.enter(f"t{n}", None, 1)
        assert isinstance(p, Pending)
    text = generate_latest(registry).decode()
    assert 'tandem_router_flow_admitted_requests_total{tenant="other"} 3.0' in text
    assert text.count("tandem_router_flow_tenant_in_flight_requests{") == 3  # two tenants and "other"


def _request(headers: dict[str, str], remote: str = "10.0.0.9") -> ServerRequest:
    return ServerRequest(None, "POST", "/v1/completions", "", headers, b"", version="1.1", keep_alive=True,  # type: ignore[arg-type]
                         remote=remote)  # fmt: skip


@pytest.mark.parametrize(
    ("settings", "headers", "identity"),
    [
        ({}, {"x-tenant": "acme"}, "peer:10.0.0.9"),  # no header named by the operator: none is read
        ({"client_id_header": "X-Tenant"}, {"x-tenant": "acme"}, "header:acme"),
        ({"client_id_header": "X-Tenant"}, {"x-other": "acme"}, "peer:10.0.0.9"),
        (
            {"api_keys": ["k1"], "client_id_header": "X-Tenant"},
            {"authorization": "Bearer k1", "x-tenant": "acme"},
            key_identity("k1"),
        ),
        ({}, {"authorization": "Bearer made-up"}, "peer:10.0.0.9"),  # keys not checked: a token names no one
    ],
)
def test_one_identity_per_client(settings: dict[str, object], headers: dict[str, str], identity: str) -> None:
    assert client_identity(_request(headers), RouterSettings.model_validate(settings)) == identity


@pytest.mark.procs
def test_a_malformed_limits_file_is_a_one_line_cli_error(tmp_path: Path) -> None:
    bad = tmp_path / "limits.yaml"
    bad.write_text("tenants: {acme: {weight: -2}}\n")
    argv = ["--prefill", "http://p:1", "--decode", "http://d:1", "--flow-limits-file", str(bad)]
    result = subprocess.run([sys.executable, "-m", "tandem.cli", "router", *argv], capture_output=True, text=True,
                            timeout=60)  # fmt: skip
    assert result.returncode == 2
    assert result.stderr.strip().splitlines() == [
        f"tandem router: --flow-limits-file: {bad}: tenants.acme.weight: Input should be greater than 0"
    ]
