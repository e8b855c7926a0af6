"""HiCache L3 storage for the simulator: KV pages keyed by the hash of the whole token prefix they end.

With ``--hicache-storage-backend file`` SGLang's ``HiCacheFile`` keeps pages as files in
``SGLANG_HICACHE_FILE_BACKEND_STORAGE_DIR`` (default ``/tmp/hicache``), shared by every worker that points there.
The decode's KV offload writes the pages it copied device->host; a prefill with the same backend writes its prompt
pages through and, on a later request with the same prefix (the next turn of a conversation), reads the longest
run of cached pages back instead of computing them. A page whose offload copy was poisoned (the second upstream
race) therefore turns into wrong text on that next turn. The ``mooncake`` backend of a prefill's HiCache is
the real Mooncake Store (``tandem_sim.pd.mooncake_store``); decode offload to it is host memory only.
"""

from __future__ import annotations

import contextlib
import hashlib
import os
from pathlib import Path
from typing import Protocol

import numpy as np

from tandem_sim.model import model

DEFAULT_FILE_DIR = "/tmp/hicache"


def chain_start(page_size: int, seed: int) -> bytes:
    return hashlib.blake2b(f"tandem-sim:{seed}:{page_size}".encode(), digest_size=16).digest()


def chain_extend(chain: bytes, ids: list[int], words: list[str]) -> bytes:
    """The key of the page holding ``ids``/``words``, after the page keyed ``chain``."""
    page = "\x1f".join(f"{i}\x1e{w}" for i, w in zip(ids, words, strict=True))
    return hashlib.blake2b(chain + page.encode(), digest_size=16).digest()


def page_keys(tokens: model.Tokens, page_size: int, seed: int) -> list[str]:
    """One key per *full* page: a hash chain over the ids and surface words of every token up to the page's end."""
    keys = []
    chain = chain_start(page_size, seed)
    for start in range(0, len(tokens.ids) - page_size + 1, page_size):
        end = start + page_size
        chain = chain_extend(chain, tokens.ids[start:end], tokens.words[start:end])
        keys.append(chain.hex())
    return keys


class L3Store(Protocol):
    """HiCache's L3 as the prefill uses it: the file backend, or the Mooncake Store
    (``tandem_sim.pd.mooncake_store``)."""

    def put(self, key: str, rows: np.ndarray) -> None: ...

    def longest_prefix(self, keys: list[str]) -> list[np.ndarray]: ...


class FileStore:
    def __init__(self, directory: str, kv_bytes: int, page_size: int) -> None:
        self.directory = Path(directory)
        self.directory.mkdir(parents=True, exist_ok=True)
        self.kv_bytes = kv_bytes
        self.page_size = page_size

    def put(self, key: str, rows: np.ndarray) -> None:
        path = self.directory / f"{key}.bin"
        tmp = path.with_suffix(f".{os.getpid()}.tmp")
        tmp.write_bytes(rows.tobytes())
        tmp.replace(path)  # readers never see half a page

    def get(self, key: str) -> np.ndarray | None:
        with contextlib.suppress(FileNotFoundError):
            raw = (self.directory / f"{key}.bin").read_bytes()
            if len(raw) == self.kv_bytes * self.page_size:
                return np.frombuffer(raw, dtype=np.uint8).reshape(self.page_size, self.kv_bytes)
        return None

    def longest_prefix(self, keys: list[str]) -> list[np.ndarray]:
        """The cached pages of the longest run of leading keys that are all present."""
        pages = []
        for key in keys:
            page = self.get(key)
            if page is None:
                break
            pages.append(page)
        return pages
