"""Paged KV memory: a device pool (registered with Mooncake on decode) and a host pool for offloaded pages.

A request owns whole pages; token ``p`` of a request lives in slot ``pages[p // page_size] * page_size +
p % page_size``. Pages are handed out LIFO so freed pages are reused at once, as SGLang's allocator does under
load, which is what turns a slot-reuse bug into visibly wrong text.
"""

from __future__ import annotations

from collections.abc import Sequence

import numpy as np
import numpy.typing as npt

from tandem_sim.model.ranks import KVLayout


class OutOfPagesError(RuntimeError):
    """The pool cannot hold the request even when empty."""


class PagedPool:
    def __init__(self, num_pages: int, page_size: int, kv_bytes: int) -> None:
        self.num_pages = num_pages
        self.page_size = page_size
        self.kv_bytes = kv_bytes
        self.data: npt.NDArray[np.uint8] = np.zeros((num_pages * page_size, kv_bytes), dtype=np.uint8)
        self._free: list[int] = list(range(num_pages - 1, -1, -1))

    @property
    def free_pages(self) -> int:
        return len(self._free)

    @property
    def used_tokens(self) -> int:
        return (self.num_pages - len(self._free)) * self.page_size

    @property
    def address(self) -> int:
        return int(self.data.ctypes.data)

    @property
    def nbytes(self) -> int:
        return int(self.data.nbytes)

    def pages_for(self, tokens: int) -> int:
        return max(1, -(-tokens // self.page_size))

    def alloc(self, tokens: int) -> list[int] | None:
        """Pages for ``tokens`` tokens, or None if not enough are free right now."""
        need = self.pages_for(tokens)
        if need > self.num_pages:
            raise OutOfPagesError(f"{tokens} tokens need {need} pages; the pool has {self.num_pages}")
        if need > len(self._free):
            return None
        taken = self._free[-need:]
        del self._free[-need:]
        taken.sort()  # ascending: adjacent pages form one contiguous run (one Mooncake transfer segment)
        return taken

    def free(self, pages: Sequence[int]) -> None:
        self._free.extend(reversed(pages))  # LIFO: the freed pages are reused first, by the next admission

    def slots(self, pages: Sequence[int], start: int, count: int) -> npt.NDArray[np.int64]:
        positions = np.arange(start, start + count, dtype=np.int64)
        page_arr = np.asarray(pages, dtype=np.int64)
        return page_arr[positions // self.page_size] * self.page_size + positions % self.page_size

    def read(self, pages: Sequence[int], start: int, count: int) -> npt.NDArray[np.uint8]:
        if count == 1:  # the decode loop's per-token path: no index arrays
            slot = pages[start // self.page_size] * self.page_size + start % self.page_size
            return self.data[slot : slot + 1].copy()
        return self.data[self.slots(pages, start, count)]

    def write(self, pages: Sequence[int], start: int, kv: npt.NDArray[np.uint8]) -> None:
        if len(kv) == 1:
            slot = pages[start // self.page_size] * self.page_size + start % self.page_size
            self.data[slot] = kv[0]
            return
        self.data[self.slots(pages, start, len(kv))] = kv


class ShardedPool:
    """The KV pool of one attention-DP group: one ``PagedPool`` shard per attention-TP rank, one page allocator.

    SGLang's TP ranks allocate identically (the same request gets the same KV indices on every rank), so pages are
    handed out once, by shard 0's allocator, and mean the same slots in every shard. Shard ``r`` holds the bytes of
    each token's row that rank ``r`` holds (``KVLayout.columns``). Reading assembles whole rows from the shards;
    where several ranks hold the same bytes (MLA's latent on every rank, or replicated GQA heads), position ``p``
    is read from holder ``p % holders``, so the text depends on every rank's copy.
    """

    def __init__(self, num_pages: int, page_size: int, layout: KVLayout) -> None:
        self.layout = layout
        self.page_size = page_size
        self.kv_bytes = layout.kv_bytes
        self.shards = [PagedPool(num_pages, page_size, layout.columns(r)[1]) for r in range(layout.attn_tp)]
        self._holders = layout.holders()
        self._single = len(self.shards) == 1

    @property
    def num_pages(self) -> int:
        return self.shards[0].num_pages

    @property
    def capacity_tokens(self) -> int:
        return self.num_pages * self.page_size

    @property
    def free_pages(self) -> int:
        return self.shards[0].free_pages

    @property
    def used_tokens(self) -> int:
        return self.shards[0].used_tokens

    def alloc(self, tokens: int) -> list[int] | None:
        return self.shards[0].alloc(tokens)

    def free(self, pages: Sequence[int]) -> None:
        self.shards[0].free(pages)

    def read(self, pages: Sequence[int], start: int, count: int) -> npt.NDArray[np.uint8]:
        if self._single:
            return self.shards[0].read(pages, start, count)
        out = np.empty((count, self.kv_bytes), dtype=np.uint8)
        positions = np.arange(start, start + count)
        for first, length, ranks in self._holders:
            if len(ranks) == 1:
                out[:, first : first + length] = self._cols(ranks[0], pages, start, count, first, length)
                continue
            for i, rank in enumerate(ranks):
                mine = np.flatnonzero(positions % len(ranks) == i)
                if len(mine):
                    rows = self._cols(rank, pages, start, count, first, length)
                    out[mine, first : first + length] = rows[mine]
        return out

    def _cols(
        self, rank: int, pages: Sequence[int], start: int, count: int, first: int, length: int
    ) -> npt.NDArray[np.uint8]:
        offset = first - self.layout.columns(rank)[0]
        return self.shards[rank].read(pages, start, count)[:, offset : offset + length]

    def write(self, pages: Sequence[int], start: int, kv: npt.NDArray[np.uint8]) -> None:
        if self._single:
            self.shards[0].write(pages, start, kv)
            return
        for rank, shard in enumerate(self.shards):
            first, length = self.layout.columns(rank)
            shard.write(pages, start, np.ascontiguousarray(kv[:, first : first + length]))
