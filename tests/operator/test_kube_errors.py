"""``Kube`` maps API errors to its own: NotFound / Conflict / permanent at once, temporary after backoff retries."""

from __future__ import annotations

from typing import Any

import aiohttp
import pytest

from tandem.kube.rest import ApiError, Request
from tandem_operator.act.k8s.kube import ConflictError, Kube, PermanentError, TemporaryError


class ScriptedApi:
    """Answers ``send`` with the next scripted outcome (an exception to raise, or a result)."""

    def __init__(self, *outcomes: Any) -> None:
        self.outcomes, self.calls = list(outcomes), 0

    async def send(self, request: Request) -> Any:
        self.calls += 1
        outcome = self.outcomes.pop(0)
        if isinstance(outcome, BaseException):
            raise outcome
        return outcome


async def test_temporary_errors_are_retried_then_succeed() -> None:
    api = ScriptedApi(
        ApiError(503, "Service Unavailable"),
        aiohttp.ClientConnectionError("reset"),
        TimeoutError(),
        {"items": [{"a": 1}]},
    )
    assert await Kube(api, backoff_s=0.001).list("v1", "Pod", "ns", "x=y") == [{"a": 1}]
    assert api.calls == 4  # the last of RETRIES


async def test_temporary_errors_give_up_after_the_retries() -> None:
    api = ScriptedApi(*[ApiError(429, "Too Many Requests")] * 4)
    with pytest.raises(TemporaryError) as err:
        await Kube(api, backoff_s=0.001).post("/api/v1/namespaces/ns/events", {})
    assert err.value.status == 429
    assert api.calls == 4


async def test_not_found_conflict_and_permanent_errors_are_not_retried() -> None:
    api = ScriptedApi(ApiError(404, "Not Found"), ApiError(404, "Not Found"), ApiError(409, "Conflict"))
    kube = Kube(api, backoff_s=0.001)
    assert await kube.get("/api/v1/namespaces/ns/pods/p") is None
    assert await kube.delete("/api/v1/namespaces/ns/pods/p") is False
    with pytest.raises(ConflictError):
        await kube.put("/api/v1/namespaces/ns/pods/p", {})
    api = ScriptedApi(ApiError(422, "Unprocessable Entity", 'PodDisruptionBudget.policy "x" is invalid'))
    with pytest.raises(PermanentError) as err:
        await Kube(api, backoff_s=0.001).post("/x", {})
    assert err.value.status == 422
    assert str(err.value) == 'POST /x: 422 Unprocessable Entity: PodDisruptionBudget.policy "x" is invalid'
    assert api.calls == 1


async def test_lists_are_read_a_page_at_a_time_trimmed_and_every_request_is_counted() -> None:
    pages = ({"items": [{"a": 1, "big": "x"}], "metadata": {"continue": "t1"}}, {"items": [{"a": 2, "big": "y"}]})
    api = ScriptedApi(ApiError(503, "Service Unavailable"), *pages)
    counted: list[str] = []
    kube = Kube(api, backoff_s=0.001, on_request=counted.append)
    assert await kube.list("v1", "Pod", "ns", "x=y", keep=lambda o: {"a": o["a"]}) == [{"a": 1}, {"a": 2}]
    assert counted == ["GET", "GET", "GET"]  # the retry counts too
