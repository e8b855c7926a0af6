"""An approximate radix tree of the prompt prefixes one prefill has been sent: a guess at its prefix cache.

The router cannot see a worker's RadixAttention cache, so, like SGLang's gateway ``smg``
(lightseekorg/smg ``crates/kv_index/src/string_tree.rs``, ``Tree::match_prefix_with_counts`` /
``Tree::insert_text`` / ``Tree::evict_tenant_by_size``), it remembers what it routed where: every request's key
is inserted into the tree of the prefill that got it, and the longest match of a new key says how much of its
prompt that prefill probably still caches. Differences from smg: one tree per prefill (smg keeps one shared tree
with a tenant set per node), keys are token ids when the request carries them and text otherwise (smg: text over
HTTP, token ids over gRPC), and eviction runs inline when the tree outgrows ``max_units`` (smg: a thread every
30 s), down to 90% of it, least recently matched or inserted leaves first.

A key is a ``str`` (units: characters) or a ``tuple[int, ...]`` (units: token ids); one tree may hold both kinds
(they never share a first unit's type, so they never share a path). Pure data structure: no I/O, no clock (LRU
order is a counter).
"""

from __future__ import annotations

import heapq
import itertools
from dataclasses import dataclass, field

RoutingKey = str | tuple[int, ...]

EVICT_TO = 0.9  # an eviction run brings the tree down to this share of its maximum size


@dataclass(eq=False)
class _Node:
    edge: RoutingKey
    parent: _Node | None
    children: dict[str | int, _Node] = field(default_factory=dict)
    last_access: int = 0


def _common_length(a: RoutingKey, start: int, edge: RoutingKey) -> int:
    """How many leading units of ``edge`` equal ``a[start:]`` (whole-slice comparisons run in C)."""
    n = min(len(edge), len(a) - start)
    if a[start : start + n] == edge[:n]:
        return n
    lo, hi = 0, n  # binary search for the first difference: O(log n) slice comparisons
    while lo < hi:
        mid = (lo + hi + 1) // 2
        if a[start : start + mid] == edge[:mid]:
            lo = mid
        else:
            hi = mid - 1
    return lo


class PrefixTree:
    def __init__(self, max_units: int) -> None:
        if max_units < 1:
            raise ValueError("max_units must be >= 1")
        self.max_units = max_units
        self.root = _Node("", None)
        self.units = 0  # units held by every edge of the tree
        self._clock = itertools.count(1)

    def match(self, key: RoutingKey) -> int:
        """Units of the longest prefix of ``key`` in the tree (a partial edge counts); touches the matched path."""
        node, pos, now = self.root, 0, next(self._clock)
        while pos < len(key):
            child = node.children.get(key[pos])
            if child is None:
                break
            shared = _common_length(key, pos, child.edge)
            child.last_access = now
            pos += shared
            if shared < len(child.edge):
                break
            node = child
        return pos

    def insert(self, key: RoutingKey) -> None:
        """Add ``key`` (its new units count towards ``max_units``), then evict if the tree outgrew it."""
        node, pos, now = self.root, 0, next(self._clock)
        while pos < len(key):
            child = node.children.get(key[pos])
            if child is None:
                node.children[key[pos]] = _Node(key[pos:], node, last_access=now)
                self.units += len(key) - pos
                break
            shared = _common_length(key, pos, child.edge)
            if shared < len(child.edge):
                child = self._split(child, shared)
            child.last_access = now
            pos += shared
            node = child
        if self.units > self.max_units:
            self._evict(int(self.max_units * EVICT_TO))

    def _split(self, child: _Node, at: int) -> _Node:
        """Cut ``child``'s edge after ``at`` units: a new inner node holds the head, ``child`` keeps the tail."""
        parent = child.parent
        assert parent is not None
        head = _Node(child.edge[:at], parent, {child.edge[at]: child}, child.last_access)
        parent.children[child.edge[0]] = head
        child.edge, child.parent = child.edge[at:], head
        return head

    def _evict(self, target: int) -> None:
        """Drop least recently used leaves (a parent left childless is a leaf in turn) until ``units`` <= target."""
        order = itertools.count()
        heap = [(n.last_access, next(order), n) for n in self._nodes() if not n.children and n is not self.root]
        heapq.heapify(heap)
        while self.units > target and heap:
            _, _, leaf = heapq.heappop(heap)
            parent = leaf.parent
            assert parent is not None
            del parent.children[leaf.edge[0]]
            self.units -= len(leaf.edge)
            if parent is not self.root and not parent.children:
                heapq.heappush(heap, (parent.last_access, next(order), parent))

    def _nodes(self) -> list[_Node]:
        out, stack = [], [self.root]
        while stack:
            node = stack.pop()
            out.append(node)
            stack.extend(node.children.values())
        return out
