"""The simulated model: word tokenizer, chat template, per-token KV bytes and a decoder that reads its KV.

Pure computation, no I/O. Three properties make the simulator useful for integrity testing:

* KV bytes are a deterministic function of (seed, token id, position): prefill and decode agree only when they
  run the same ``--sim-seed`` ("weights"). The token id is recoverable from a slot's bytes, whatever its
  position, so the model can copy tokens out of its context (induction heads do that in real models). Words it
  makes up itself come from a "common" part of the vocabulary; a rarer word in the output was copied.
* The decoder's output depends on the KV bytes it reads back from the decode's own memory: it digests the whole
  prompt KV once, then every step reads one or two context slots chosen by a hash of the running state and
  either copies the token stored there or emits a vocabulary word. A slot that was overwritten by another
  request (slot reuse) therefore makes the output carry words of the *foreign prompt*, like the upstream
  offload race did.
* Aggregated mode computes the same KV locally, so it is the reference text for PD mode.
"""

from __future__ import annotations

import hashlib
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from functools import cache

import numpy as np
import numpy.typing as npt

VOCAB_SIZE = 4096
EOS_ID = 0
_SPECIAL = ("</s>", "<|system|>", "<|user|>", "<|assistant|>", "<|tool|>", "<|end|>")
FIRST_WORD_ID = 64  # ids below are special tokens (unused ones are reserved)
COMMON_WORDS_END = 1024  # the decoder's own words come from [FIRST_WORD_ID, COMMON_WORDS_END); rarer ones are copied
_CONSONANTS = "bdfgklmnprstvz"
_VOWELS = "aeiou"
_SYLLABLES = [c + v for c in _CONSONANTS for v in _VOWELS]  # 70 syllables; CV pairs decode uniquely

KV = npt.NDArray[np.uint8]


@cache
def vocabulary() -> tuple[str, ...]:
    words = list(_SPECIAL) + [f"<|reserved{i}|>" for i in range(len(_SPECIAL), FIRST_WORD_ID)]
    for i in range(VOCAB_SIZE - FIRST_WORD_ID):
        words.append(_SYLLABLES[i // len(_SYLLABLES) % len(_SYLLABLES)] + _SYLLABLES[i % len(_SYLLABLES)])
    return tuple(words)


@cache
def _word_ids() -> dict[str, int]:
    return {word: i for i, word in enumerate(vocabulary())}


def encode(text: str) -> list[int]:
    """Whitespace word tokenizer: vocabulary words map to their id, any other word to a hashed word id."""
    ids = _word_ids()
    out = []
    for word in text.split():
        known = ids.get(word)
        if known is None:
            digest = hashlib.blake2b(word.encode(), digest_size=4).digest()
            known = FIRST_WORD_ID + int.from_bytes(digest, "little") % (VOCAB_SIZE - FIRST_WORD_ID)
        out.append(known)
    return out


def decode_tokens(token_ids: Sequence[int]) -> str:
    vocab = vocabulary()
    return " ".join(vocab[t] for t in token_ids if t != EOS_ID)


def apply_chat_template(messages: Sequence[tuple[str, str]]) -> str:
    """``[(role, content), ...]`` -> prompt text, ending with the assistant turn marker."""
    parts = []
    for role, content in messages:
        marker = {"system": "<|system|>", "user": "<|user|>", "assistant": "<|assistant|>"}.get(role, "<|tool|>")
        parts.append(f"{marker} {content} <|end|>")
    parts.append("<|assistant|>")
    return " ".join(parts)


@dataclass(frozen=True)
class Weights:
    """The simulated weights: a per-token embedding and masks derived from the seed."""

    seed: int
    kv_bytes: int
    embedding: npt.NDArray[np.uint8]  # (VOCAB_SIZE, kv_bytes)
    token_mask: int
    position_mask: int


@cache
def weights(seed: int, kv_bytes: int) -> Weights:
    rng = np.random.default_rng(seed)
    embedding = rng.integers(0, 256, size=(VOCAB_SIZE, kv_bytes), dtype=np.uint8)
    masks = hashlib.blake2b(f"masks:{seed}".encode(), digest_size=8).digest()
    return Weights(seed, kv_bytes, embedding, int.from_bytes(masks[:4], "little"), int.from_bytes(masks[4:], "little"))


def compute_kv(w: Weights, token_ids: Sequence[int], start_pos: int = 0) -> KV:
    """KV bytes of ``token_ids`` at positions ``start_pos..``: shape (n, kv_bytes).

    Bytes 0..3 hold the token id (xor a seed mask), 4..7 the position (xor another), the rest the token's
    embedding mixed with a position pattern.
    """
    tokens = np.asarray(token_ids, dtype=np.uint32)
    positions = np.arange(start_pos, start_pos + len(tokens), dtype=np.uint32)
    lanes = np.arange(w.kv_bytes, dtype=np.uint32)
    mix = ((positions[:, None] * np.uint32(2654435761) + lanes[None, :] * np.uint32(40503)) >> np.uint32(13)) & 0xFF
    kv = w.embedding[tokens] ^ mix.astype(np.uint8)
    kv[:, 0:4] = (tokens ^ np.uint32(w.token_mask)).astype("<u4").view(np.uint8).reshape(-1, 4)
    kv[:, 4:8] = (positions ^ np.uint32(w.position_mask)).astype("<u4").view(np.uint8).reshape(-1, 4)
    return kv


def token_from_kv(w: Weights, row: KV) -> int:
    """The token a KV slot holds (any slot, any position); garbage bytes still give a valid id."""
    raw = int.from_bytes(bytes(row[0:4]), "little") ^ w.token_mask
    return raw % VOCAB_SIZE


@dataclass(frozen=True)
class SamplingParams:
    max_new_tokens: int = 128
    min_new_tokens: int = 0
    temperature: float = 1.0
    top_p: float = 1.0
    top_k: int = -1
    ignore_eos: bool = False
    stop: tuple[str, ...] = ()
    sampling_seed: int | None = None

    def key(self) -> bytes:
        """What the text depends on (besides KV): the sampling knobs, not the length limits."""
        return repr((self.temperature, self.top_p, self.top_k, self.sampling_seed)).encode()


class Decoder:
    """Generates tokens from KV read through ``read_row(position) -> KV row`` (the decode's own memory)."""

    def __init__(self, w: Weights, prompt_len: int, params: SamplingParams, read_rows: Callable[[int, int], KV]):
        self.w = w
        self.params = params
        self.read_rows = read_rows  # (start, count) -> rows of positions start..start+count
        self.length = prompt_len
        self.step_index = 0
        prompt_kv = read_rows(0, prompt_len)
        digest = hashlib.blake2b(prompt_kv.tobytes(), digest_size=16, key=b"prompt")
        digest.update(params.key())
        self.state = digest.digest()

    def next_token(self) -> int:
        """One decode step: read context slots, pick a token. The caller writes its KV at ``self.length``."""
        h = hashlib.blake2b(self.state + self.step_index.to_bytes(4, "little"), digest_size=16).digest()
        pos = int.from_bytes(h[0:4], "little") % self.length
        rows = self.read_rows(pos, min(2, self.length - pos))
        read_token = token_from_kv(self.w, rows[0])
        if h[4] % 8 < 5 and len(rows) == 2:
            token = token_from_kv(self.w, rows[1])  # induction: copy what followed the token seen there
        elif h[4] % 8 < 6:
            token = read_token
        else:
            common = COMMON_WORDS_END - FIRST_WORD_ID
            token = FIRST_WORD_ID + (int.from_bytes(h[5:9], "little") ^ read_token) % common
        if token < FIRST_WORD_ID:
            token = FIRST_WORD_ID + token  # never emit template markers
        if (
            not self.params.ignore_eos
            and self.step_index >= self.params.min_new_tokens
            and self.step_index > 0
            and h[9] < 3
        ):
            token = EOS_ID
        self.state = hashlib.blake2b(self.state + rows.tobytes() + token.to_bytes(4, "little"), digest_size=16).digest()
        self.step_index += 1
        self.length += 1
        return token
