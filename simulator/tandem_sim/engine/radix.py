"""RadixAttention's prefix cache of one attention-DP group, as SGLang 0.5.23 keeps it (``mem_cache/radix_cache.py``).

What is modelled:

- ``match_prefix``: the longest cached prefix of the prompt, in whole pages (``RadixKey.page_aligned``), and at
  most ``len(prompt) - 1`` tokens (``Req._compute_max_prefix_len``: the last token is always computed, for its
  logits); the matched tokens skip prefill compute and are SGLang's ``req.cached_tokens``
  (``meta_info.cached_tokens``);
- ``insert``: after a prompt's prefill its pages are in the tree (``cache_unfinished_req``), and in aggregated mode
  prompt + output when the request finishes (``cache_finished_req``), so the next turn of a conversation hits;
- eviction: least recently used leaves first (``RadixCache.evict``, ``last_access_time``) while the tree holds more
  than the KV pool can spare (``--max-total-tokens`` minus the tokens running requests hold).

What is not: the tree keeps token keys only and the KV of a hit is recomputed (the same bytes, so the text is the
same); cached pages are not shared with the request's pool pages, so admission does not count them (see the
fidelity table).
"""

from __future__ import annotations

import heapq
import itertools
from dataclasses import dataclass, field

Key = tuple[tuple[int, str], ...]  # one page of (token id, surface word)


@dataclass(eq=False)
class _Node:
    key: Key
    parent: _Node | None
    children: dict[Key, _Node] = field(default_factory=dict)
    last_access: int = 0


class RadixCache:
    def __init__(self, page_size: int) -> None:
        self.page_size = page_size
        self.root = _Node((), None)
        self.cached_tokens = 0  # tokens held by the tree
        self._clock = itertools.count(1)  # logical time: deterministic LRU order

    def reset(self) -> None:
        """``/flush_cache`` (``RadixCache.reset``)."""
        self.root = _Node((), None)
        self.cached_tokens = 0

    def _pages(self, ids: list[int], words: list[str], limit: int) -> list[Key]:
        ps, n = self.page_size, limit - limit % self.page_size
        pairs = list(zip(ids[:n], words[:n], strict=True))
        return [tuple(pairs[i : i + ps]) for i in range(0, n, ps)]

    def match_prefix(self, ids: list[int], words: list[str]) -> int:
        """Cached tokens of the prompt (whole pages, at most ``len - 1``); touches the matched path."""
        node, matched, now = self.root, 0, next(self._clock)
        for page in self._pages(ids, words, max(len(ids) - 1, 0)):
            child = node.children.get(page)
            if child is None:
                break
            child.last_access = now
            node, matched = child, matched + len(page)
        return matched

    def insert(self, ids: list[int], words: list[str], capacity: int) -> None:
        """Put the sequence's whole pages in the tree, then evict LRU leaves down to ``capacity`` tokens."""
        node, now = self.root, next(self._clock)
        for page in self._pages(ids, words, len(ids)):
            child = node.children.get(page)
            if child is None:
                child = _Node(page, node)
                node.children[page] = child
                self.cached_tokens += len(page)
            child.last_access = now
            node = child
        self.evict(capacity)

    def evict(self, capacity: int) -> None:
        if self.cached_tokens <= capacity:
            return
        leaves = [(n.last_access, id(n), n) for n in self._nodes() if not n.children]
        heapq.heapify(leaves)
        while self.cached_tokens > capacity and leaves:
            _, _, leaf = heapq.heappop(leaves)
            parent = leaf.parent
            assert parent is not None
            del parent.children[leaf.key]
            self.cached_tokens -= len(leaf.key)
            if parent is not self.root and not parent.children:
                heapq.heappush(leaves, (parent.last_access, id(parent), parent))

    def _nodes(self) -> list[_Node]:
        out, stack = [], list(self.root.children.values())
        while stack:
            node = stack.pop()
            out.append(node)
            stack.extend(node.children.values())
        return out
