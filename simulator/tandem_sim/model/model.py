"""The simulated model: word tokenizer, chat template, per-token KV bytes and a decoder that reads its KV.

Pure computation, no I/O. Five properties make the simulator useful for integrity testing:

* KV bytes are a deterministic function of (seed, token id, surface word, position): prefill and decode agree
  only when they run the same ``--sim-seed`` ("weights"). A slot's bytes hold the token id, the position it was
  computed for, and the token's surface form (the prompt's real word, UTF-8, XORed with a keystream of seed and
  position), so whatever a slot holds can be read back as a word. Copying out of the context (induction heads do
  that in real models) reproduces the actual words of whatever prompt wrote the slot.
* The decoder's output depends on the KV bytes it reads back from the decode's own memory: it digests the whole
  prompt KV once, then every step reads a context slot chosen by a hash of the running state and copies the
  word there (sometimes a short run of following words) or emits a common vocabulary word. A slot overwritten by
  another request (slot reuse) holds a foreign position: the model then collapses into a loop over those slots,
  which repeats the *foreign prompt's words*, as the upstream offload race did.
* Clean output never loops: a word that would make the output's tail one phrase repeated three times is
  replaced by a common word (the router's detectors flag loops; a clean model must not trip them).
* Aggregated mode computes the same KV locally, so it is the reference text for PD mode (token for token under
  the same kernels; with ``--enable-deterministic-inference`` under any).
* GPU numerics are batch-variant by default (``numerics.py``): a greedy step whose top two candidates are nearly
  tied flips with the batch it ran in (decode batch padded to its CUDA graph; the first token's prefill batch), as
  real SGLang without ``--enable-deterministic-inference`` does, so the same prompt alone and in a crowded batch
  can give different answers, which first differ at such a near-tie.
"""

from __future__ import annotations

import copy
import dataclasses
import hashlib
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from functools import cache, lru_cache

import numpy as np
import numpy.typing as npt

from tandem_sim.model.numerics import (
    DETERMINISTIC,
    TAIL_STEP,
    Candidate,
    Numerics,
    StepLogprobs,
    Variant,
    margin,
    tail_ratio,
    top_two_logprobs,
)

VOCAB_SIZE = 4096
EOS_ID = 0
_SPECIAL = ("</s>", "<|system|>", "<|user|>", "<|assistant|>", "<|tool|>", "<|end|>")
FIRST_WORD_ID = 64  # ids below are special tokens (unused ones are reserved)
COMMON_WORDS_END = 1024  # the decoder's own words come from [FIRST_WORD_ID, COMMON_WORDS_END); rarer ones are copied
_CONSONANTS = "bdfgklmnprstvz"
_VOWELS = "aeiou"
_SYLLABLES = [c + v for c in _CONSONANTS for v in _VOWELS]  # 70 syllables; CV pairs decode uniquely

# KV row layout: [0:4] token id ^ mask, [4:8] position ^ mask, [8] surface length, [9:9+cap] surface UTF-8 (both
# XORed with the token's embedding and the position pattern), the rest the embedding XOR the position pattern.
_SURFACE_AT = 8
MIN_KV_BYTES = 64  # room for words of up to 55 UTF-8 bytes; longer words are carried as their vocabulary id
MAX_LOOP_PERIOD = 16  # clean output never has a phrase of <= this many words three times in a row at its end

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


@dataclass(frozen=True)
class Tokens:
    """A tokenized text: vocabulary ids and the surface word of each token."""

    ids: list[int]
    words: list[str]


@lru_cache(maxsize=1 << 16)
def _hashed_id(word: str) -> int:
    digest = hashlib.blake2b(word.encode(), digest_size=4).digest()
    return FIRST_WORD_ID + int.from_bytes(digest, "little") % (VOCAB_SIZE - FIRST_WORD_ID)


def tokenize(text: str) -> Tokens:
    """Whitespace word tokenizer: vocabulary words map to their id, any other word to a hashed word id; every
    token keeps its surface word. Text of whitespace only is one token (a real tokenizer encodes it too)."""
    known = _word_ids()
    words = text.split() or ([text] if text else [])
    ids = [known.get(w, -1) for w in words]
    return Tokens([i if i >= 0 else _hashed_id(w) for i, w in zip(ids, words, strict=True)], words)


def from_ids(token_ids: Sequence[int]) -> Tokens:
    """Token ids given directly (``input_ids``): their surface is the vocabulary word."""
    vocab = vocabulary()
    return Tokens(list(token_ids), [vocab[t] for t in token_ids])


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
    embedding_rows: tuple[bytes, ...] = field(repr=False)  # the embedding as bytes, for reading single slots

    @property
    def surface_capacity(self) -> int:
        return min(self.kv_bytes - _SURFACE_AT - 1, 255)


@cache
def weights(seed: int, kv_bytes: int) -> Weights:
    if kv_bytes < MIN_KV_BYTES:
        raise ValueError(f"kv_bytes must be >= {MIN_KV_BYTES}, got {kv_bytes}")
    rng = np.random.default_rng(seed)
    embedding = rng.integers(0, 256, size=(VOCAB_SIZE, kv_bytes), dtype=np.uint8)
    masks = hashlib.blake2b(f"masks:{seed}".encode(), digest_size=8).digest()
    return Weights(
        seed,
        kv_bytes,
        embedding,
        int.from_bytes(masks[:4], "little"),
        int.from_bytes(masks[4:], "little"),
        tuple(row.tobytes() for row in embedding),
    )


_PATTERN_TABLE_POSITIONS = 32768  # positions whose pattern is precomputed (the default context length)


def _compute_pattern(positions: npt.NDArray[np.uint32], kv_bytes: int) -> KV:
    lanes = np.arange(kv_bytes, dtype=np.uint32)
    mix = (positions[:, None] * np.uint32(2654435761) + lanes[None, :] * np.uint32(40503)) >> np.uint32(13)
    return (mix & np.uint32(0xFF)).astype(np.uint8)


@cache
def _pattern_table(kv_bytes: int) -> KV:
    return _compute_pattern(np.arange(_PATTERN_TABLE_POSITIONS, dtype=np.uint32), kv_bytes)


def _position_pattern(kv_bytes: int, positions: npt.NDArray[np.uint32]) -> KV:
    """A per-(position, lane) byte pattern (uint32 arithmetic: any claimed position has one)."""
    if len(positions) and int(positions[-1]) < _PATTERN_TABLE_POSITIONS:
        first = int(positions[0])
        return _pattern_table(kv_bytes)[first : first + len(positions)]  # positions are consecutive
    return _compute_pattern(positions, kv_bytes)


def _pattern_bytes(kv_bytes: int, position: int) -> bytes:
    if position < _PATTERN_TABLE_POSITIONS:
        return bytes(_pattern_table(kv_bytes)[position])
    return bytes(_compute_pattern(np.asarray([position], dtype=np.uint32), kv_bytes)[0])


def _pack_surfaces(tokens: Tokens, capacity: int) -> KV:
    """(n, 1 + longest): length byte then UTF-8 bytes, zero padded. Length 0 means "the vocabulary word of the
    token id": used for vocabulary words themselves (nothing to store) and words longer than ``capacity``."""
    vocab = vocabulary()
    raws = [b"" if vocab[i] == word else word.encode() for i, word in zip(tokens.ids, tokens.words, strict=True)]
    fitting = [len(raw) if len(raw) <= capacity else 0 for raw in raws]
    lengths = np.asarray(fitting, dtype=np.int64)
    width = max(fitting, default=0) + 1
    packed = np.zeros((len(raws), width), dtype=np.uint8)
    packed[:, 0] = lengths
    total = sum(fitting)
    if total:
        data = np.frombuffer(b"".join(raw for raw, n in zip(raws, fitting, strict=True) if n), dtype=np.uint8)
        rows = np.repeat(np.arange(len(raws)), lengths)
        starts = np.repeat(np.cumsum(lengths) - lengths, lengths)
        packed[rows, 1 + np.arange(total) - starts] = data
    return packed


def compute_kv(w: Weights, tokens: Tokens, start_pos: int = 0) -> KV:
    """KV bytes of ``tokens`` at positions ``start_pos..``: shape (n, kv_bytes).

    Every byte is the token's embedding XOR a position pattern; bytes 0..3 are then replaced by the token id and
    4..7 by the position (each XOR a seed mask), and the surface word is XORed into bytes 8.. (so reading it back
    needs the seed's embedding of the token and the position the slot claims).
    """
    if len(tokens.ids) == 1:
        return _one_token_kv(w, tokens.ids[0], tokens.words[0], start_pos)
    ids = np.asarray(tokens.ids, dtype=np.uint32)
    positions = np.arange(start_pos, start_pos + len(ids), dtype=np.uint32)
    kv = w.embedding[ids] ^ _position_pattern(w.kv_bytes, positions)
    kv[:, 0:4] = (ids ^ np.uint32(w.token_mask)).astype("<u4").view(np.uint8).reshape(-1, 4)
    kv[:, 4:8] = (positions ^ np.uint32(w.position_mask)).astype("<u4").view(np.uint8).reshape(-1, 4)
    packed = _pack_surfaces(tokens, w.surface_capacity)
    kv[:, _SURFACE_AT : _SURFACE_AT + packed.shape[1]] ^= packed
    return kv


def _xor(a: bytes, b: bytes) -> bytes:
    return (int.from_bytes(a, "big") ^ int.from_bytes(b, "big")).to_bytes(len(a), "big")


def _one_token_kv(w: Weights, token: int, word: str, position: int) -> KV:
    """``compute_kv`` of one token (the decode loop's per-token path), with bytes instead of array operations."""
    row = bytearray(_xor(w.embedding_rows[token], _pattern_bytes(w.kv_bytes, position)))
    row[0:4] = (token ^ w.token_mask).to_bytes(4, "little")
    row[4:8] = ((position ^ w.position_mask) & 0xFFFFFFFF).to_bytes(4, "little")
    raw = b"" if vocabulary()[token] == word else word.encode()
    packed = bytes([len(raw)]) + raw if len(raw) <= w.surface_capacity else b"\0"
    end = _SURFACE_AT + len(packed)
    row[_SURFACE_AT:end] = _xor(bytes(row[_SURFACE_AT:end]), packed)
    return np.frombuffer(bytes(row), dtype=np.uint8).reshape(1, w.kv_bytes)


@dataclass(frozen=True)
class SlotReading:
    """What one KV slot says: token id, the position it was computed for, and its surface word."""

    token: int
    position: int
    word: str


def detokenize(raw: bytes) -> str:
    """A slot's surface bytes as text, the way SGLang's detokenizer turns token bytes into text.

    SGLang decodes output ids with the tokenizer (``DetokenizerManager`` in ``sglang/srt/managers/
    detokenizer_manager.py``): every valid UTF-8 sequence comes out as exactly its characters (zero-width and
    control characters included), and U+FFFD appears only for bytes that are not valid UTF-8; while streaming it
    holds back an incomplete character (``find_printable_text``) until the next token completes it. A simulated
    token is a whole word, so a clean slot (the prompt's own word) is always complete, valid UTF-8 and comes back
    unchanged; only corrupted bytes produce U+FFFD.
    """
    return raw.decode("utf-8", errors="replace")


def read_slot(w: Weights, raw: bytes) -> SlotReading:
    """Read one slot's bytes (any position, garbage too): garbage still gives a token id and a word."""
    token = (int.from_bytes(raw[0:4], "little") ^ w.token_mask) % VOCAB_SIZE
    position = int.from_bytes(raw[4:8], "little") ^ w.position_mask
    if token < FIRST_WORD_ID:
        return SlotReading(token, position, vocabulary()[token])
    key = w.embedding_rows[token]
    pattern = _pattern_bytes(w.kv_bytes, position)
    length = raw[_SURFACE_AT] ^ key[_SURFACE_AT] ^ pattern[_SURFACE_AT]
    if length == 0:
        return SlotReading(token, position, vocabulary()[token])
    a, b = _SURFACE_AT + 1, _SURFACE_AT + 1 + min(length, w.surface_capacity)
    plain = int.from_bytes(raw[a:b], "big") ^ int.from_bytes(key[a:b], "big") ^ int.from_bytes(pattern[a:b], "big")
    return SlotReading(token, position, detokenize(plain.to_bytes(b - a, "big")))


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
    sample_index: int = 0  # which of ``n`` parallel samples (they differ unless greedy)

    def key(self) -> bytes:
        """What the text depends on (besides KV): the sampling knobs, not the length limits."""
        knobs: tuple[object, ...] = (self.temperature, self.top_p, self.top_k, self.sampling_seed)
        if self.sample_index and self.temperature > 0:
            knobs += (self.sample_index,)
        return repr(knobs).encode()


def replace_sample(params: SamplingParams, index: int) -> SamplingParams:
    return dataclasses.replace(params, sample_index=index)


def closes_loop(words: Sequence[str], max_period: int = MAX_LOOP_PERIOD) -> bool:
    """True if the last word makes the tail one phrase of <= ``max_period`` words repeated three times."""
    n = len(words)
    last = words[-1] if n else None
    for period in range(1, max_period + 1):
        if n < 3 * period:
            return False
        if words[n - 1 - period] != last or words[n - 1 - 2 * period] != last:
            continue
        tail = words[n - period :]
        if words[n - 2 * period : n - period] == tail and words[n - 3 * period : n - 2 * period] == tail:
            return True
    return False


class Decoder:
    """Generates tokens from KV read through ``read_rows(start, count)`` (the decode's own memory).

    Every decision is a function of the context (the KV rows so far) and the sampling knobs, as in a real
    model: the running state is a rolling digest over the context rows, so decoding ``k`` tokens after prompt
    ``P`` leaves the same state as prefilling ``P`` plus those ``k`` tokens. A stream resumed elsewhere with its
    generated tokens appended to the prompt (the router's resume) therefore continues token for token, as a
    temperature-0 continuation does on SGLang with ``--enable-deterministic-inference``.

    Batch-variant numerics (``numerics.py``, SGLang's default): each step has a top-1 token and a runner-up (a
    common word, never the top-1, never a template marker, never one that closes a loop) whose logit gap is a
    function of the state (``numerics.margin``); ``next_token(variant)`` adds the perturbation of the kernels that
    ran the step (``Numerics.perturbation``: the padded decode batch size, or for the first token the prefill
    batch) and takes the runner-up when the gap goes negative. The flipped token rolls into the state, so the
    answer diverges from there, as on a GPU. A step without a variant, a deterministic ``Numerics``, EOS and a
    collapsed (corrupted-KV) loop are never flipped. The hot path adds no hash: the margin is read from the state,
    and the perturbation is hashed only at near-ties (about 1 step in 100) or when logprobs are asked for
    (``top_logprobs`` not None: ``self.logprobs`` then holds the step's ``StepLogprobs``).
    """

    def __init__(
        self,
        w: Weights,
        prompt_len: int,
        params: SamplingParams,
        read_rows: Callable[[int, int], KV],
        numerics: Numerics | None = None,
        top_logprobs: int | None = None,
    ):
        self.w = w
        self.params = params
        self.read_rows = read_rows
        self.prompt_len = prompt_len
        self.length = prompt_len
        self.step_index = 0
        self.numerics = DETERMINISTIC if numerics is None else numerics
        self.top_logprobs = top_logprobs  # None: no logprobs; k: the chosen token's logprob and the top k
        self.logprobs: StepLogprobs | None = None  # the last step's (when asked for)
        self.last_row: KV | None = None  # the KV row of the last token (what the caller writes at length - 1)
        prompt_kv = read_rows(0, prompt_len)
        state = hashlib.blake2b(params.key(), digest_size=16, key=b"prompt").digest()
        for row in prompt_kv:
            state = _roll(state, row.tobytes())
        self.state = state
        tail = [read_slot(w, row.tobytes()) for row in prompt_kv[-3 * MAX_LOOP_PERIOD :]]
        self.words: list[str] = [slot.word for slot in tail]  # the context's last words (loop guard)
        self.last_token = tail[-1].token if tail else EOS_ID
        self._loop: tuple[int, int] | None = None  # collapsed: (first position, period) of the slots it repeats

    def fork(self, read_rows: Callable[[int, int], KV]) -> Decoder:
        """A copy that continues from the same state over another copy of the context (``calibration``)."""
        twin = copy.copy(self)
        twin.read_rows = read_rows
        twin.words = list(self.words)
        return twin

    def near_tie(self) -> bool:
        """Some variant could flip the next step (a clean, batch-variant step whose margin is below sigma)."""
        return self._loop is None and self.numerics.near_tie(self.state)

    def flips(self, variant: Variant | None) -> bool:
        """The next step takes the runner-up under ``variant`` (unless it ends in EOS or a collapse)."""
        return margin(self.state) + self.numerics.perturbation(self.state, variant) < 0

    def _read(self, pos: int) -> tuple[SlotReading, bytes]:
        raw = self.read_rows(pos, 1)[0].tobytes()
        return read_slot(self.w, raw), raw

    def _common(self, h: bytes, offset: int, read_token: int) -> int:
        common = COMMON_WORDS_END - FIRST_WORD_ID
        return FIRST_WORD_ID + (int.from_bytes(h[offset : offset + 4], "little") ^ read_token) % common

    def _collapse(self, pos: int, h: bytes) -> None:
        """The slot at ``pos`` holds KV computed for another position: attention collapses onto those slots."""
        period = min(8 + h[11] % 5, self.prompt_len)
        start = min(pos, self.prompt_len - period) if pos < self.prompt_len else max(0, pos - period + 1)
        self._loop = (start, period)

    def _runner_up(self, top: int) -> tuple[int, str]:
        """The step's second candidate: a common word from the state's bytes 4..7, not the top-1, not closing a
        loop."""
        common = COMMON_WORDS_END - FIRST_WORD_ID
        first = int.from_bytes(self.state[4:8], "little")
        recent = self.words[-3 * MAX_LOOP_PERIOD :]
        token, word = top, ""
        for attempt in range(64):
            token = FIRST_WORD_ID + (first + 97 * attempt) % common
            word = vocabulary()[token]
            if token != top and not closes_loop([*recent, word]):
                break
        return token, word

    def _tail(self, avoid: tuple[int, int], first_logprob: float, count: int) -> tuple[Candidate, ...]:
        """Candidates 3.. of the step's top logprobs: distinct common words, ``TAIL_STEP`` nats apart."""
        common = COMMON_WORDS_END - FIRST_WORD_ID
        start = int.from_bytes(self.state[8:12], "little")
        out: list[Candidate] = []
        j = 0
        while len(out) < count and j < common:
            token = FIRST_WORD_ID + (start + 131 * j) % common
            j += 1
            if token not in avoid:
                out.append(Candidate(token, vocabulary()[token], first_logprob - TAIL_STEP * len(out)))
        return tuple(out)

    def _numerics(self, token: int, word: str, variant: Variant | None) -> tuple[int, str]:
        """Apply the step's perturbation (a near-tie may flip to the runner-up) and record its logprobs."""
        state, numerics = self.state, self.numerics
        want = self.top_logprobs is not None
        clean = self._loop is None
        if not want and not (clean and variant is not None and numerics.near_tie(state)):
            return token, word
        gap = margin(state)
        eps = numerics.perturbation(state, variant) if clean else 0.0
        observed = gap + eps
        runner, runner_word = self._runner_up(token)
        top = Candidate(token, word, 0.0)
        second = Candidate(runner, runner_word, 0.0)
        if observed < 0:
            top, second = second, top
        if want:
            lp_top, lp_runner, lp_tail = top_two_logprobs(observed, tail_ratio(state))
            hi, lo = (lp_top, lp_runner) if observed >= 0 else (lp_runner, lp_top)
            k = self.top_logprobs or 0
            tail = self._tail((token, runner), lp_tail, k - 2) if k > 2 else ()
            self.logprobs = StepLogprobs(
                Candidate(top.token, top.word, hi), Candidate(second.token, second.word, lo), gap, eps, tail
            )
        return top.token, top.word

    def next_token(self, variant: Variant | None = None) -> tuple[int, str]:
        """One decode step under ``variant`` (what the kernels saw: ``numerics.DecodeVariant`` of the step's padded
        batch, or the ``PrefillVariant`` for the first token; None: unperturbed). Read a context slot, pick a token
        and its word. The caller writes its KV (``self.last_row``) at ``self.length - 1``."""
        h = hashlib.blake2b(self.state, digest_size=16, key=b"step").digest()
        if self._loop is None:
            pos = int.from_bytes(h[0:4], "little") % self.length
            mode = h[4] % 8
            if mode < 5:  # induction: copy what followed the slot seen there
                pos = min(pos + 1, self.length - 1)
            slot, _ = self._read(pos)
            if slot.position != pos:
                self._collapse(pos, h)
        if self._loop is not None:
            start, period = self._loop
            pos = start + self.step_index % period
            slot, _ = self._read(pos)
            token, word = slot.token, slot.word
        elif mode < 6:
            token, word = slot.token, slot.word
        else:
            token = self._common(h, 5, slot.token)
            word = vocabulary()[token]
        if token < FIRST_WORD_ID:
            token = FIRST_WORD_ID + token  # never emit template markers
            word = vocabulary()[token]
        self.logprobs = None
        if self._loop is None:
            attempt = 0
            while attempt < 64 and closes_loop([*self.words[-3 * MAX_LOOP_PERIOD :], word]):
                token = self._common(h, 5 + attempt % 8, attempt)
                word = vocabulary()[token]
                attempt += 1
            # EOS only after a common word: a prompt ending in a template marker is never answered with nothing.
            # EOS is never flipped (its decision is the state's alone).
            if (
                not self.params.ignore_eos
                and self.step_index >= self.params.min_new_tokens
                and FIRST_WORD_ID <= self.last_token < COMMON_WORDS_END
                and h[9] < 3
            ):
                token, word = EOS_ID, ""
        if token != EOS_ID:
            token, word = self._numerics(token, word, variant)
        self.step_index += 1
        if token != EOS_ID:
            row = _one_token_kv(self.w, token, word, self.length)
            self.last_row = row
            self.state = _roll(self.state, row.tobytes())
            self.length += 1
            self.words.append(word)
            self.last_token = token
        return token, word


def _roll(state: bytes, row: bytes) -> bytes:
    """The running state after one more context row."""
    return hashlib.blake2b(state + row, digest_size=16).digest()
