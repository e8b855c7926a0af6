"""Which pairs a router probes with known-answer canaries in one round (pure).

Probing every pair every round costs P x D canaries per router (15,625 a round for 125 x 125 groups, in each
router). The races this guards against live in one worker, a decode's KV offload or a pair's transfer path, so the
plan covers *workers*, each round, and *pairs* over rounds:

- **Rotation**: the workers of the larger role are each paired with ``sample`` workers of the other role, at an
  offset that moves by ``sample`` every round. Each round then probes ``sample x max(P, D)`` pairs; every worker of
  either role is in at least ``sample`` of them (the smaller role in about ``sample x max/min``), and every pair
  comes round once every ``ceil(min(P, D) / sample)`` rounds (``rounds_to_cover``).
- **Probe first**: pairs under suspicion (an unconfirmed detector finding, a worker that failed a comparison, a
  failed transfer) and pairs of a worker seen for the first time (a recreated group) go before the rotation, so a
  budget that cuts the round cuts the rotation, not them.
- **Shared between routers**: every router computes the same rotation (workers sorted by key, the round number from
  the wall clock) and probes only the pairs it owns: the router with the highest rendezvous hash of (router, pair)
  among the routers registered in the registry. Adding routers adds no probing; when a router leaves, its pairs
  move to the others the round after its registration expired (each pair to one of them: rendezvous hashing
  moves only the leaver's pairs).

**Beside race bursts** (``race_plan``: every decode swept through prefills that rotate by burst, so every worker of
either role is probed under the concurrency the races need), a round keeps only ``rotated_at_most`` pairs of the
rotation (``ROTATION_BESIDE_BURSTS``): enough answers for a majority, which keeps the canary prompts' references
(the bursts of probation and confirmation judge against them) up to date. The full rotation costs ``sample x
max(P, D)`` canaries a round (250 of 32 tokens every 30 s at 125 x 125: 60 % of a 1 % budget) and covers nothing
the bursts do not.

Detection bound: a decode that garbles every answer it gives while under load is probed
through ``sample`` pairs every round; it fails ``threshold`` probes in the first round that finds it under load,
so it is quarantined within one interval plus the probes' own time. A decode that garbles on one specific prefill
only is met by that prefill within ``rounds_to_cover`` rounds. Live traffic (the detectors, shadows and the bursts
that confirm their findings) usually finds it sooner: canaries are the floor, not the main path.
"""

from __future__ import annotations

import hashlib
import math
from collections.abc import Collection, Iterable, Sequence

PairKey = tuple[str, str]

DEFAULT_SAMPLE = 2  # partners per worker per round
ROTATION_BESIDE_BURSTS = 3  # rotated pairs a router probes a round while race bursts sweep: a majority of answers


def round_number(wall_time_s: float, interval_s: float) -> int:
    """The round a tick at ``wall_time_s`` belongs to: rounds start at multiples of ``interval_s`` of the wall clock
    (routers' clocks are NTP-synchronised), and a tick up to half an interval early or late counts for the
    nearest one, so routers ticking a little apart agree."""
    return math.floor(wall_time_s / interval_s + 0.5)


def rotation(prefills: Sequence[str], decodes: Sequence[str], round_no: int, sample: int) -> list[PairKey]:
    """``sample`` partners for each worker of the larger role, offset by ``round_no x sample`` (see the module
    docstring). Workers are sorted here, so every router derives the same pairs from the same members."""
    ps, ds = sorted(set(prefills)), sorted(set(decodes))
    if not ps or not ds:
        return []
    many, few, decode_is_many = (ds, ps, True) if len(ds) >= len(ps) else (ps, ds, False)
    width = min(sample, len(few))
    offset = round_no * width
    pairs: list[PairKey] = []
    for i, worker in enumerate(many):
        for j in range(width):
            partner = few[(i + offset + j) % len(few)]
            pairs.append((partner, worker) if decode_is_many else (worker, partner))
    return pairs


def rounds_to_cover(prefills: int, decodes: int, sample: int) -> int:
    """Rounds until every pair was in a rotation once."""
    if prefills == 0 or decodes == 0:
        return 0
    return math.ceil(min(prefills, decodes) / min(sample, prefills, decodes))


def rendezvous_owner(pair: PairKey, routers: Iterable[str]) -> str | None:
    """The router that probes ``pair``: the highest hash of (router, pair). None without routers."""
    best: tuple[bytes, str] | None = None
    for router in routers:
        digest = hashlib.blake2b(f"{router}\n{pair[0]}\n{pair[1]}".encode(), digest_size=8).digest()
        if best is None or (digest, router) > best:
            best = (digest, router)
    return None if best is None else best[1]


def plan_round(
    pairs: Collection[PairKey],
    round_no: int,
    sample: int,
    first: Iterable[PairKey],
    routers: Collection[str],
    me: str,
    rotated_at_most: int | None = None,
) -> list[PairKey]:
    """The pairs this router (``me``) probes this round, in order: its share of the ``first`` pairs, then its share
    of the rotation over the workers of ``pairs`` (at most ``rotated_at_most`` of them, a window that moves by that
    many every round). Pairs the pool cannot form (gone workers) are left out."""
    members = set(routers) | {me}
    formable = set(pairs)
    firsts = [p for p in sorted(set(first)) if p in formable and rendezvous_owner(p, members) == me]
    taken = set(firsts)
    rotated = [
        p
        for p in dict.fromkeys(rotation([p for p, _ in formable], [d for _, d in formable], round_no, sample))
        if p not in taken and rendezvous_owner(p, members) == me
    ]
    if rotated_at_most is not None and len(rotated) > rotated_at_most:
        start = round_no * rotated_at_most
        rotated = [rotated[(start + i) % len(rotated)] for i in range(rotated_at_most)]
    return [*firsts, *rotated]
