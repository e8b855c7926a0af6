"""Fuzz the router's OpenAPI document (generated from its pydantic models) with schemathesis: never a 5xx.

The router runs as a real process in front of two real instant PD workers, so accepted requests go through the
whole PD path; rejected ones must be 4xx OpenAI errors.
"""

from __future__ import annotations

import sys
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
import requests
import schemathesis
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from schemathesis.checks import not_a_server_error
from schemathesis.core.result import Ok
from schemathesis.schemas import APIOperation

from tandem_dev.procs import ManagedProcess, free_port
from tandem_router.openai.openapi import document
from tests.router.helpers import start_instant_workers

pytestmark = pytest.mark.procs

schema = schemathesis.openapi.from_dict(document())


@pytest.fixture(scope="module")
def router_url(tmp_path_factory: pytest.TempPathFactory) -> Iterator[str]:
    logs = tmp_path_factory.mktemp("fuzz")
    procs: list[ManagedProcess] = []
    try:
        urls = start_instant_workers(procs, logs)
        port = free_port()
        argv = [sys.executable, "-m", "tandem.cli", "router", "--port", str(port), "--prefill", urls["prefill"], "8998",
                "--decode", urls["decode"], "--max-body-bytes", "65536"]  # fmt: skip
        router = ManagedProcess("router", argv, logs / "router.log").start()
        procs.append(router)
        router.wait_http(f"http://127.0.0.1:{port}/readiness")
        yield f"http://127.0.0.1:{port}"
        assert router.alive(), router.log_tail()
        assert "Traceback" not in Path(router.log_path).read_text(), router.log_tail(80)
    finally:
        for proc in reversed(procs):
            proc.stop()


@pytest.fixture(scope="module")
def session() -> Iterator[requests.Session]:
    with requests.Session() as s:
        yield s


# One test id per operation (``schema.parametrize()`` gives all six the same node id, and pytest-xdist, which runs
# tests by node id, then ran only the first of them).
RESULTS = list(schema.get_all_operations())
OPERATIONS = [result.ok() for result in RESULTS if isinstance(result, Ok)]
assert len(OPERATIONS) == len(RESULTS), "an operation of the router's document is invalid"


@pytest.mark.parametrize("operation", OPERATIONS, ids=[op.label for op in OPERATIONS])
@settings(max_examples=40, deadline=None, suppress_health_check=list(HealthCheck))
@given(data=st.data())
def test_no_server_errors(
    operation: APIOperation[Any, Any, Any, Any], data: st.DataObject, router_url: str, session: requests.Session
) -> None:
    case = data.draw(operation.as_strategy())
    case.call_and_validate(base_url=router_url, session=session, checks=[not_a_server_error], timeout=10)
