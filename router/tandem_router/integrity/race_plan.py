"""Staggered race bursts: which decode a router probes next, through which prefills, and its share of the probing
budget (pure).

The decode KV-offload races (SGLang's, and the simulator's ``--sim-inject-offload-race``) garble an answer only
when a second request is admitted to the decode while the first still attends to prompt pages the race handed
back at its first offload. A lightly loaded decode of a large fleet rarely runs two requests at once, so live
traffic may not show the race for minutes, and a canary round (one request per pair, all admitted together) never
does. A *race burst* creates that concurrency: ``BURST`` known-answer probes through one decode (through distinct
prefills where there are several), each sent a fraction of a probe's time after the one before, so each arrives
while the earlier ones decode. Their prompts are ``PROMPT_WORDS`` words long, one short of a page boundary for
every page size dividing 64 (16, 32 and 64 tokens, for a tokenizer that makes one token of each word), so the
first generated token fills the page and sets off the offload at once; and they are distinct, so the KV a later
probe writes into the handed-back pages is not the earlier one's own. On a racing decode every probe but the last
reads another's prompt: ``BURST`` - 1 answers DIFFERENT from their references, two failures through two prefills
in one burst, which quarantines the decode (``QuarantinePolicy.threshold`` and ``worker_spread`` 2).

Who probes which decode: the router with the highest rendezvous hash of (router, decode) among the cluster's
routers, as the canary rounds split their pairs, so adding routers adds no bursts and a leaving router's decodes
move to the others. Each router sweeps its decodes in a fixed order, decodes with a pair under suspicion first,
as fast as its budget allows, but a decode at most ``BURSTS_PER_INTERVAL`` times per canary interval
(``--canary-interval-s`` paces both; the first burst comes that long after the router started). Its budget is the
share of the cluster's probing budget its decodes are (``budget_weight``): the routers together never probe more
than the one budget, however many they are.

Detection bound: a router owning ``n`` decodes, whose bursts cost ``c`` request-seconds each and whose budget
refills at ``r`` request-seconds a second, comes back to a decode within ``sweep_s(n, c, r)`` = ``n x c / r``; a
decode that starts racing is quarantined within the larger of that and ``interval_s / BURSTS_PER_INTERVAL``, plus
one burst's time, and every other router adopts it about a second later. A router's budget is its decodes' share
of the cluster's (``r = share x C x n / D``), so the sweep is ``c / (share x S)`` whatever the fleet's size, ``S``
the slots of one decode (``C / D``): about 15 s for bursts of 1.2 request-seconds on decodes of 8 slots at 1 %.
"""

from __future__ import annotations

import bisect
from collections.abc import Collection, Iterable, Sequence

from tandem_router.integrity.probe_plan import rendezvous_owner

BURST = 3  # probes a burst: two victims and the last one's thief
TOKENS = 16  # tokens each probe decodes: enough to read a thief's KV after the stagger, cheap enough to sweep often
PROMPT_WORDS = 63  # one short of a multiple of 64: the first generated token fills a page of 16, 32 or 64
BURSTS_PER_INTERVAL = 6  # a decode gets at most this many bursts per canary interval (one per 5 s by default)
STAGGER_SHARE = 1 / 3  # of a race probe's quickest recent time, between one probe of a burst and the next

_WORDS = (
    "please",
    "repeat",
    "the",
    "following",
    "list",
    "of",
    "ordinary",
    "words",
    "about",
    "a",
    "small",
    "harbour",
    "town",
    "with",
    "boats",
    "nets",
    "gulls",
    "ropes",
    "tides",
    "lanterns",
    "bakers",
    "morning",
    "bread",
    "fishermen",
    "weather",
    "stones",
    "bridges",
    "gardens",
    "walls",
    "windows",
    "chimneys",
    "smoke",
    "clocks",
    "bells",
    "markets",
    "apples",
    "pears",
    "cheese",
    "salt",
    "wind",
    "rain",
    "clouds",
    "hills",
    "paths",
    "fences",
    "sheep",
    "dogs",
    "carts",
    "wheels",
    "lamps",
    "books",
    "letters",
    "stamps",
    "maps",
)


def prompts() -> tuple[str, ...]:
    """``BURST`` distinct prompts of exactly ``PROMPT_WORDS`` whitespace-separated words."""
    out = []
    for i in range(BURST):
        head = [f"race-canary-{i}:"]
        body = [_WORDS[(i * 7 + j) % len(_WORDS)] for j in range(PROMPT_WORDS - 1)]
        out.append(" ".join(head + body))
    return tuple(out)


def owner(decode: str, routers: Iterable[str]) -> str | None:
    """The router that sends ``decode``'s race bursts."""
    return rendezvous_owner(("race", decode), routers)


def my_decodes(decodes: Iterable[str], routers: Collection[str], me: str) -> list[str]:
    """The decodes ``me`` sweeps, sorted (``me`` counts as a member whether registered yet or not)."""
    members = set(routers) | {me}
    return sorted(d for d in set(decodes) if owner(d, members) == me)


def budget_weight(decodes: Collection[str], routers: Collection[str], me: str) -> float:
    """The share of the cluster's probing budget this router may spend: the share of the decodes it sweeps (the
    weights of all routers sum to 1). Without decodes: an equal share."""
    members = set(routers) | {me}
    if not decodes:
        return 1.0 / len(members)
    return len(my_decodes(decodes, members, me)) / len(set(decodes))


def next_decode(mine: Sequence[str], suspects: Collection[str], last: str | None) -> str | None:
    """The decode to burst next: a suspect first (the first after ``last`` in order, so two suspects alternate),
    else the one after ``last`` in ``mine`` (wrapping round); None without decodes."""
    if not mine:
        return None
    start = 0 if last is None else bisect.bisect_right(mine, last) % len(mine)
    order = [*mine[start:], *mine[:start]]
    return next((d for d in order if d in suspects), order[0])


def first_turn(decode: str, decodes: Collection[str]) -> int:
    """The turn of ``decode``'s first burst: its place among the cluster's decodes, sorted, so that the decodes'
    bursts start ``BURST`` prefills apart and one sweep of the decodes goes through every prefill (``BURST x D``
    probes over ``P`` prefills), not all through the same ``BURST``."""
    return sorted(set(decodes) | {decode}).index(decode)


def burst_prefills(prefills: Sequence[str], turn: int) -> list[str]:
    """``BURST`` prefills for a burst: distinct ones where there are enough, starting at an offset that moves by
    ``BURST`` each turn (so the decode meets every prefill over the turns), the same ones again where there are
    fewer. Empty without prefills."""
    ps = sorted(set(prefills))
    if not ps:
        return []
    return [ps[(turn * BURST + i) % len(ps)] for i in range(BURST)]


def sweep_s(decodes: int, burst_cost_s: float, rate: float) -> float:
    """Seconds between two bursts through one decode: ``decodes`` bursts of ``burst_cost_s`` request-seconds at
    ``rate`` request-seconds a second (infinite without a budget)."""
    if decodes == 0:
        return 0.0
    return decodes * burst_cost_s / rate if rate > 0 else float("inf")
