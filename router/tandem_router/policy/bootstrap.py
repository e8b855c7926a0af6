"""The PD bootstrap fields the router adds to a request body (reference §1)."""

from __future__ import annotations

import random
from typing import Any
from urllib.parse import urlsplit

MAX_ROOM = 2**63 - 1


def new_room(rng: random.Random, dp_size: int = 1, dp_rank: int | None = None) -> int:
    """A fresh random room in [0, 2^63-1]. With attention-DP the prefill serves it on rank ``room % dp_size``;
    ``dp_rank`` pins that rank (otherwise it is uniform, like the room)."""
    if dp_size <= 1:
        return rng.randint(0, MAX_ROOM)
    rank = rng.randrange(dp_size) if dp_rank is None else dp_rank % dp_size
    return rng.randint(0, (MAX_ROOM - rank) // dp_size) * dp_size + rank


def bootstrap_host(prefill_url: str) -> str:
    host = urlsplit(prefill_url).hostname
    if not host:
        raise ValueError(f"prefill URL has no host: {prefill_url!r}")
    return host


def inject(
    body: dict[str, Any],
    *,
    host: str,
    port: int | None,
    items: int,
    rng: random.Random,
    dp_size: int = 1,
) -> dict[str, Any]:
    """A copy of ``body`` with ``bootstrap_host/port/room``; ``items`` > 0 gives lists, one fresh room per item."""
    out = dict(body)
    if items == 0:
        out["bootstrap_host"] = host
        out["bootstrap_port"] = port
        out["bootstrap_room"] = new_room(rng, dp_size)
    else:
        out["bootstrap_host"] = [host] * items
        out["bootstrap_port"] = [port] * items
        out["bootstrap_room"] = [new_room(rng, dp_size) for _ in range(items)]
    return out
