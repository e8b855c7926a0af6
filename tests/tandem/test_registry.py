from __future__ import annotations

import asyncio

import pydantic
import pytest

from tandem import registry
from tandem.registry import Endpoint, Role
from tandem.registry_etcd import PrefixWatcher, grpc_target


def test_endpoint_round_trip_and_key() -> None:
    ep = Endpoint(
        role=Role.PREFILL,
        group="prefill-0",
        url="http://127.0.0.5:30000",
        bootstrap_port=8998,
        mooncake_sessions=("127.0.0.5:15000", "127.0.0.5:15001"),
        model="kimi-k2.6",
        revision="abc",
        epoch=3,
    )
    assert registry.decode(registry.encode(ep)) == ep
    assert registry.endpoint_key("ns", "c1", ep) == "/tandem/v1/clusters/ns/c1/endpoints/prefill/prefill-0"
    assert registry.endpoint_key("ns", "c1", ep).startswith(registry.cluster_prefix("ns", "c1"))


@pytest.mark.parametrize(
    ("field", "value"),
    [("url", "not a url"), ("bootstrap_port", 70000), ("mooncake_sessions", ["nohostport"]), ("epoch", -1)],
)
def test_endpoint_rejects_bad_fields(field: str, value: object) -> None:
    base: dict[str, object] = {
        "role": "decode",
        "group": "decode-0",
        "url": "http://127.0.0.1:1",
        "model": "m",
    }
    with pytest.raises(pydantic.ValidationError, match=field):
        Endpoint.model_validate({**base, field: value})


def test_integrity_report_round_trip_and_key() -> None:
    report = registry.IntegrityReport(
        router="host-a:123",
        quarantined=(
            registry.QuarantinedPair(prefill="http://p0:1", decode="http://d1:2", reason="prompt_leak", since_s=1.5),
        ),
        quarantined_workers=("http://d1:2",),
    )
    assert registry.IntegrityReport.model_validate_json(report.model_dump_json()) == report
    key = registry.integrity_key("ns", "c1", report.router)
    assert key == "/tandem/v1/clusters/ns/c1/integrity/host-a:123"
    assert not key.startswith(registry.cluster_prefix("ns", "c1"))  # endpoint watchers never see reports


def incarnation(epoch: int, *sessions: str) -> Endpoint:
    """One incarnation of the decode group ``decode-0`` with these Mooncake session ids."""
    return Endpoint(
        role=Role.DECODE, group="decode-0", url="http://10.0.0.1:1", model="m", epoch=epoch, mooncake_sessions=sessions
    )


def test_session_history_finds_ids_any_earlier_incarnation_held() -> None:
    history = registry.SessionHistory()
    assert history.note("d0", incarnation(0, "10.0.0.1:15100", "10.0.0.1:15101")) == {}
    assert history.note("d0", incarnation(1, "10.0.0.1:15102", "10.0.0.1:15103")) == {}  # the next window
    assert history.note("d0", incarnation(1, "10.0.0.1:15102")) == {}  # the same incarnation put again
    assert history.note("other", incarnation(0, "10.0.0.1:15100")) == {}  # another group's history
    # the rotation wrapped: ids of epoch 0, two incarnations back, and of epoch 1
    assert history.note("d0", incarnation(2, "10.0.0.1:15101", "10.0.0.1:15102", "10.0.0.2:15100")) == {
        "10.0.0.1:15101": 0,
        "10.0.0.1:15102": 1,
    }
    assert history.note("d0", incarnation(1, "10.0.0.1:15101")) == {}  # a stale value changes nothing
    assert history.note("d0", incarnation(3, "10.0.0.2:15100")) == {"10.0.0.2:15100": 2}


def test_session_history_forgets_the_oldest_ids_past_its_limit() -> None:
    history = registry.SessionHistory(limit=2)
    history.note("d0", incarnation(0, "10.0.0.1:15100"))
    history.note("d0", incarnation(1, "10.0.0.2:15100"))
    history.note("d0", incarnation(2, "10.0.0.3:15100"))
    assert history.note("d0", incarnation(3, "10.0.0.1:15100")) == {}  # forgotten: the oldest of three
    assert history.note("d0", incarnation(4, "10.0.0.3:15100")) == {"10.0.0.3:15100": 2}


def test_grpc_target_names_every_etcd_member() -> None:
    assert grpc_target(["http://etcd.ns.svc:2379"]) == "etcd.ns.svc:2379"  # gRPC's DNS resolver: all its addresses
    assert grpc_target(["127.0.0.1:1", "http://127.0.0.2:2/", "127.0.0.1:1"]) == "ipv4:127.0.0.1:1,127.0.0.2:2"
    assert grpc_target(["localhost:3", "127.0.0.1:4"]) == "ipv4:127.0.0.1:3,127.0.0.1:4"
    assert grpc_target(["[::1]:5", "http://[::2]:6"]) == "ipv6:[::1]:5,[::2]:6"
    with pytest.raises(ValueError, match="mix IPv6"):
        grpc_target(["[::1]:5", "127.0.0.1:6"])
    with pytest.raises(ValueError, match="no etcd endpoint given"):
        grpc_target([])


async def test_a_watcher_stops_even_when_its_task_loses_a_cancellation() -> None:
    """As when aetcd's ``wait_for`` (Python 3.11) swallows the cancel that ``stop()`` sends: stop cancels again."""
    watcher = PrefixWatcher(["127.0.0.1:1"], "/p/", lambda key, value: None, _noop)
    swallowed = asyncio.Event()

    async def loses_one_cancel() -> None:
        try:
            await asyncio.sleep(3600)
        except asyncio.CancelledError:
            swallowed.set()  # the cancellation is lost here...
        await asyncio.sleep(3600)  # ...and the task goes on waiting

    watcher._task = asyncio.create_task(loses_one_cancel())
    await asyncio.sleep(0)
    async with asyncio.timeout(10):
        await watcher.stop()
    assert swallowed.is_set()
    assert watcher._task.cancelled()


async def _noop(current: dict[str, object]) -> None:
    return None
