"""Paged KV memory: a device pool (registered with Mooncake on decode) and a host pool for offloaded pages.

A request owns whole pages; token ``p`` of a request lives in slot ``pages[p // page_size] * page_size +
p % page_size``. Pages are handed out LIFO so freed pages are reused at once, as SGLang's allocator does under
load, which is what turns a slot-reuse bug into visibly wrong text.
"""

from __future__ import annotations

from collections.abc import Sequence

import numpy as np
import numpy.typing as npt


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
