"""``WorkerPool.serves``: the model check of every proxied request, the same answer as ``model in models()``
(or nothing known), without building the set per request."""

from __future__ import annotations

import itertools

import pytest

from tandem.registry import Role
from tandem_router.pool import WorkerPool, WorkerSpec


def _pool(spec_models: tuple[str | None, str | None], learned: tuple[set[str], set[str]]) -> WorkerPool:
    pool = WorkerPool()
    pool.replace_all(
        [
            WorkerSpec(Role.PREFILL, "http://p:1", model=spec_models[0]),
            WorkerSpec(Role.DECODE, "http://d:1", model=spec_models[1]),
        ]
    )
    for worker, names in zip(pool.workers.values(), learned, strict=True):
        worker.models = frozenset(names)
    return pool


SPEC_MODELS = [(None, None), ("a", None), (None, "b"), ("a", "b")]
LEARNED: list[tuple[set[str], set[str]]] = [(set(), set()), ({"a"}, set()), (set(), {"c"}), ({"a", "c"}, {"b"})]


@pytest.mark.parametrize(("spec_models", "learned"), list(itertools.product(SPEC_MODELS, LEARNED)))
@pytest.mark.parametrize("also", [(), ("x",), ("a",)])
def test_serves_agrees_with_the_set_of_every_model_named(
    spec_models: tuple[str | None, str | None], learned: tuple[set[str], set[str]], also: tuple[str, ...]
) -> None:
    pool = _pool(spec_models, learned)
    known = pool.models() | set(also)
    for model in ("a", "b", "c", "x", "nope"):
        assert pool.serves(model, also) is (not known or model in known), (model, known)


def test_an_unknown_model_is_refused_once_any_worker_names_one() -> None:
    pool = _pool((None, None), (set(), set()))
    assert pool.serves("anything")
    pool.workers["decode:http://d:1"].models = frozenset({"kimi"})
    assert not pool.serves("anything")
    assert pool.serves("kimi")
