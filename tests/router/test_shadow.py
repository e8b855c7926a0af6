from __future__ import annotations

from typing import Any

import pytest

from tandem_router.openai.requests import sampling


@pytest.mark.parametrize(
    ("body", "expected"),
    [
        ({"text": "x", "sampling_params": {"temperature": 0}}, True),
        ({"text": "x", "sampling_params": {"temperature": 0.7, "sampling_seed": 3}}, True),
        ({"text": "x", "sampling_params": {"temperature": 0.7}}, False),
        ({"text": "x"}, False),  # SGLang's default temperature is 1
        ({"model": "m", "prompt": "x", "temperature": 0}, True),
        ({"model": "m", "messages": [], "seed": 7}, True),
        ({"model": "m", "messages": []}, False),
    ],
)
def test_deterministic(body: dict[str, Any], expected: bool) -> None:
    assert sampling(body)[1] is expected
