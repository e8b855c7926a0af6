"""The parsed request (#37): each fact the router decides on is read from the body once, where it is validated, and
is what the readers read before (stream, choices, bootstrap items, output limit, priority, model, temperature 0 or
seeded); the body forwarded stays the client's canonical body, byte for byte. Pure, except the last test (loopback
instant workers)."""

from __future__ import annotations

from typing import Any

import orjson
import pytest

from tandem_router.app import _parse
from tandem_router.flow.requests import CHARS_PER_TOKEN, estimated_tokens
from tandem_router.openai.requests import ParsedRequest
from tandem_router.openai.schema import ROUTES, Route, item_count
from tandem_router.server import Reply
from tests.router.helpers import stack

MESSAGES = [{"role": "user", "content": "hi"}]
BODIES: list[tuple[Route, dict[str, Any]]] = [
    (Route.CHAT, {"model": "m", "messages": MESSAGES}),
    (Route.CHAT, {"model": "m", "messages": MESSAGES, "stream": True, "n": 3, "max_tokens": 7, "temperature": 0}),
    (Route.CHAT, {"model": "m", "messages": MESSAGES, "max_completion_tokens": 5, "max_tokens": 9, "seed": 1}),
    (Route.CHAT, {"model": "m", "messages": MESSAGES, "max_tokens": 0, "priority": 4, "temperature": 0.5}),
    (Route.COMPLETIONS, {"model": "m", "prompt": "Once", "stream": False, "priority": True}),
    (Route.COMPLETIONS, {"model": "m", "prompt": ["a", "b"], "n": 2, "max_tokens": 12, "priority": -2}),
    (Route.COMPLETIONS, {"model": "m", "prompt": [[1, 2], [3]], "stream": True, "seed": 3, "temperature": 1}),
    (Route.GENERATE, {"text": "x"}),
    (Route.GENERATE, {"text": "x", "model": "m", "stream": True, "sampling_params": {"max_new_tokens": 4, "n": 2}}),
    (Route.GENERATE, {"text": ["a", "b"], "sampling_params": {"temperature": 0, "max_new_tokens": 2.5, "n": 0}}),
    (Route.GENERATE, {"input_ids": [[1], [2]], "sampling_params": [{"n": 2}, {}], "priority": 1.0}),
    (Route.GENERATE, {"input_ids": [1, 2], "sampling_params": {"sampling_seed": 9, "max_new_tokens": None}}),
]


def _sampling_before(body: dict[str, Any]) -> tuple[bool, bool]:
    """``probes.shadow.greedy`` and ``deterministic`` before #37."""
    params = body.get("sampling_params")
    if not isinstance(params, dict):
        params = body
    greedy = bool(params.get("temperature", 1.0) == 0)
    if params.get("sampling_seed") is not None or params.get("seed") is not None:
        return greedy, True
    return greedy, greedy


def _before(route: Route, body: dict[str, Any], prompt_chars: int) -> dict[str, Any]:
    """What the readers read from the body before #37 (app, flow.requests, probes.shadow)."""
    model = body.get("model")
    priority = body.get("priority")
    fields = body.get("sampling_params") if route is Route.GENERATE else body
    limits = ROUTES[route].output_limits
    limit = next((fields[k] for k in limits if k in fields), None) if isinstance(fields, dict) else None
    output = limit if isinstance(limit, int) and not isinstance(limit, bool) and limit > 0 else 0
    return {
        "model": model if isinstance(model, str) else None,
        "stream": body.get("stream") is True,
        "items": item_count(route, body),
        "priority": priority if isinstance(priority, int) and not isinstance(priority, bool) else None,
        # every sequence generated: a batch's prompts x choices (before: OpenAI's n alone, /generate one choice)
        "estimate": prompt_chars / CHARS_PER_TOKEN + output * max(item_count(route, body), 1),
        "greedy": _sampling_before(body)[0],
        "deterministic": _sampling_before(body)[1],
    }


@pytest.mark.parametrize(("route", "body"), BODIES)
def test_each_fact_is_what_the_readers_read_before(route: Route, body: dict[str, Any]) -> None:
    parsed = ParsedRequest.of(route, body)
    after = {
        "model": parsed.model,
        "stream": parsed.stream,
        "items": parsed.items,
        "priority": parsed.priority,
        "estimate": estimated_tokens(parsed, 40),
        "greedy": parsed.greedy,
        "deterministic": parsed.deterministic,
    }
    assert after == _before(route, body, 40)
    assert parsed.route is route
    assert parsed.body is body  # the body forwarded is the one parsed, not a copy


@pytest.mark.parametrize(
    ("route", "body", "sequences"),
    [
        (Route.CHAT, {"model": "m", "messages": MESSAGES, "max_tokens": 10}, 1),
        (Route.CHAT, {"model": "m", "messages": MESSAGES, "max_tokens": 10, "n": 3}, 3),
        (Route.COMPLETIONS, {"model": "m", "prompt": ["a", "b"], "max_tokens": 10, "n": 2}, 4),
        (Route.GENERATE, {"text": "x", "sampling_params": {"max_new_tokens": 10, "n": 8}}, 8),
        (Route.GENERATE, {"text": ["a", "b", "c"], "sampling_params": {"max_new_tokens": 10}}, 3),
    ],
)
def test_flow_control_charges_every_sequence_a_request_generates(
    route: Route, body: dict[str, Any], sequences: int
) -> None:
    """n choices (on any route) or a batch of prompts cost the output limit once per sequence: one request asking
    for 8 does not get them at the price of one (#36's flow control, /generate's ``sampling_params.n`` included)."""
    assert estimated_tokens(ParsedRequest.of(route, body), 40) == 40 / CHARS_PER_TOKEN + 10 * sequences


@pytest.mark.parametrize(
    ("route", "body", "limit", "completions_limit", "generate_limit"),
    [
        (Route.CHAT, {"max_completion_tokens": 5, "max_tokens": 9}, 5, 5, 5),
        (Route.CHAT, {"max_tokens": 9}, 9, 9, 9),
        (Route.COMPLETIONS, {}, None, 16, 128),  # not set: the worker's default
        (Route.GENERATE, {"sampling_params": {"max_new_tokens": 3}}, 3, 3, 3),
        (Route.GENERATE, {"sampling_params": {"max_new_tokens": None}}, None, 16, 128),
        (Route.GENERATE, {"sampling_params": {"max_new_tokens": 2.5}}, None, None, None),  # set, not an integer
    ],
)
def test_the_output_limit_as_set_and_as_the_worker_applies_it(
    route: Route, body: dict[str, Any], limit: int | None, completions_limit: int | None, generate_limit: int | None
) -> None:
    parsed = ParsedRequest.of(route, body)
    assert parsed.output_limit == limit
    assert (parsed.limit_or(16), parsed.limit_or(128)) == (completions_limit, generate_limit)
    assert ROUTES[route].output_limits  # where the limit is read: the route table


def test_the_workers_priority_is_a_new_body_with_the_same_bytes_as_setting_it_in_place() -> None:
    for route, body in BODIES:
        parsed = ParsedRequest.of(route, body)
        before = orjson.dumps(body)
        given = parsed.with_priority(7)
        assert orjson.dumps(body) == before  # the parsed request's body is not changed
        assert (given.priority, parsed.priority) == (7, parsed.priority)
        in_place = orjson.loads(before)
        in_place["priority"] = 7
        assert orjson.dumps(given.body) == orjson.dumps(in_place)  # the same key order, the same bytes
        assert (given.stream, given.items, given.output_limit) == (parsed.stream, parsed.items, parsed.output_limit)


def test_the_request_is_parsed_once_where_it_is_validated() -> None:
    raw = orjson.dumps({"model": "m", "messages": MESSAGES, "n": 2.0, "max_tokens": None, "stream": True})
    parsed = _parse(raw, Route.CHAT, ROUTES[Route.CHAT].model)
    assert isinstance(parsed, ParsedRequest)
    assert parsed.body == {"model": "m", "messages": MESSAGES, "n": 2, "stream": True}  # canonical
    assert (parsed.n, parsed.items, parsed.stream, parsed.output_limit) == (2, 2, True, None)
    refused = _parse(b'{"model": "m", "messages": []}', Route.CHAT, ROUTES[Route.CHAT].model)
    assert isinstance(refused, Reply)
    assert refused.status == 400


async def test_the_workers_get_the_effective_priority_when_asked_to() -> None:
    body = {"model": "instant-model", "messages": MESSAGES, "priority": 3}
    async with stack(1, 1, flow_worker_priority=True) as s:
        status, _ = await s.post("/v1/chat/completions", body)
        assert status == 200
        (got,) = await s.received(s.decodes[0])
        assert got["body"]["priority"] == 0  # the effective priority (every tenant equal), not the one asked
        assert list(got["body"])[:3] == ["model", "messages", "priority"]  # where the client put it
    async with stack(1, 1) as s:
        status, _ = await s.post("/v1/chat/completions", body)
        assert status == 200
        (got,) = await s.received(s.decodes[0])
        assert got["body"]["priority"] == 3  # as sent
