"""Two answers to the same request: the same, apart by GPU numerics only, or different (pure).

SGLang without ``--enable-deterministic-inference`` is not batch-invariant: the reduction order of its kernels
follows the batch a request runs in, so a logit differs in its last bits from one batch to the next. At a step
whose top-two tokens are nearly tied the argmax flips, and the rest of the answer diverges from there (1,000
temperature-0 completions of one prompt gave 80 distinct answers, the first divergence at token 103: Thinking
Machines Lab, "Defeating Nondeterminism in LLM Inference", 2025). Two clean pairs may therefore return different
texts for the same temperature-0 request; text equality alone would fail their canaries and shadows and never
release a pair from probation.

``compare(a, b)`` tells the cases apart with the per-token logprobs the workers return:

- SAME: equal texts.
- NUMERICAL: the texts agree up to a point, and at the token where they first differ the other answer's token is
  the runner-up (one of the two most likely tokens) of a side that has logprobs, with a margin (top-1 logprob minus
  that token's logprob) of at most ``near_tie_nats``. When both sides have logprobs both must say so: each side's
  token is in the other's top two with a small margin. What follows the flip is not compared: a different token
  in the context legitimately changes everything after it.
- DIFFERENT: everything else: another request's words, garbage, a confident token flipped, one answer stopping
  where the other's top two hold no end of sequence, texts that differ where the tokens do not. Without logprobs on
  either side only SAME or DIFFERENT is possible.

A garbling decode reads KV that is not its request's: the token where it departs is drawn from the wrong
distribution, so it is not the reference's near-tied runner-up (and when it has logprobs of its own, the
reference's token is not its runner-up either). The judgement is only as good as the first divergence: what comes
after a genuine near-tie flip is not checked (probation therefore asks for an agreed prefix, ``probation.py``).

Clients cannot make their own requests look like corruption or like numerics: comparisons are always of the same
request on different pairs, the router picks the canary prompts, and the logprobs compared come only from requests
the router makes (``with_logprobs`` on a copy of the body); a client's own answer enters as its text alone.

Alignment is tokenizer-agnostic: each token is placed in the answer's UTF-8 bytes by its own bytes (OpenAI chat's
``bytes``, the completions route's latin-1 rendering of a partial character, else the token's text); a token whose
text does not occur there (U+FFFD for part of a character, a special token the text leaves out) is placed where
the next placed token resumes. The first differing byte is mapped to the token that holds it on each side.
"""

from __future__ import annotations

import math
from collections.abc import Iterable
from dataclasses import dataclass, replace
from enum import StrEnum
from typing import Any

import orjson

from tandem_router.integrity.textextract import CHAT, COMPLETIONS, GENERATE, doc_texts

NEAR_TIE_NATS = 0.5
"""Default largest top-1 minus runner-up logprob margin at which a flipped token counts as numerics.

bf16 keeps 8 significant bits: a logit's relative precision is 2^-8, and one ulp is 0.125 at ``|logit|`` in
[16, 32), where the top logits of large models sit. Batch-variant reductions (matmul split-K, split-KV attention,
the all-reduce) move a logit by a few ulps; a logprob margin is a logit margin (log-softmax shares the normaliser),
and it moves by the sum of both logits' moves: 2 x 2 ulps = 0.5 nats. A flip by numerics needs a margin within
those few ulps, so 0.5 nats takes every such flip at those magnitudes while a confident choice (margins of whole
nats) still counts as a difference. Larger logits (ulp 0.25 in [32, 64)) or more variant kernels may need more:
``--integrity-near-tie-nats``."""

MIN_AGREED_TOKENS = 8
"""Tokens a NUMERICAL answer of a pair on probation must have agreed on before its flip to count as a clean
comparison (an earlier flip counts neither way); the reasons are in ``probation.py``."""

TOP_LOGPROBS = 2  # alternatives the router asks for on the requests it compares

# End-of-sequence markers as tokenizers render them (Kimi K2: [EOS], <|im_end|>; DeepSeek's uses fullwidth bars).
END_MARKERS = frozenset(
    {
        "</s>", "<eos>", "[EOS]", "<end_of_turn>", "<|im_end|>", "<|endoftext|>", "<|end_of_text|>", "<|eot_id|>",
        "<|eom_id|>", "<|end|>", "<|return|>", "<\uff5cend\u2581of\u2581sentence\uff5c>",
    }
)  # fmt: skip


class Kind(StrEnum):
    SAME = "same"
    NUMERICAL = "numerical"
    DIFFERENT = "different"


@dataclass(frozen=True)
class Token:
    """One output token (or one alternative in ``top``): its text as the worker rendered it, its logprob, and
    what identifies it exactly when the worker said so (token id; raw bytes)."""

    text: str
    logprob: float
    top: tuple[Token, ...] = ()  # the most likely tokens at this step, as returned (the chosen one usually first)
    token_id: int | None = None
    raw: bytes | None = None


@dataclass(frozen=True)
class Answer:
    """An answer's text, its tokens when the worker returned logprobs, and the seconds the worker itself took over
    it when it said so (SGLang's ``meta_info.e2e_latency`` on ``/generate``: its tokenizer manager's time from the
    request's arrival to its end, ``TokenizerManager._handle_batch_output``)."""

    text: str
    tokens: tuple[Token, ...] | None = None
    worker_s: float | None = None


@dataclass(frozen=True)
class Verdict:
    kind: Kind
    char: int | None = None  # first differing character (of either text; they agree before it)
    token: int | None = None  # index of the token where they part (a side with logprobs); tokens agreed before it
    reason: str = ""

    @property
    def agrees(self) -> bool:
        """SAME or NUMERICAL: no evidence against either answer."""
        return self.kind is not Kind.DIFFERENT


# -- requests and responses ----------------------------------------------------------------------------------------


def with_logprobs(route: str, body: dict[str, Any]) -> dict[str, Any]:
    """A copy of ``body`` that asks for each output token's logprob and its top two (the client's body is left as
    it is; whatever logprob fields it had are replaced in the copy)."""
    if route == GENERATE:
        return {**body, "return_logprob": True, "top_logprobs_num": TOP_LOGPROBS, "return_text_in_logprobs": True}
    if route == CHAT:
        return {**body, "logprobs": True, "top_logprobs": TOP_LOGPROBS}
    if route == COMPLETIONS:
        return {**body, "logprobs": TOP_LOGPROBS}
    return dict(body)


def body_answers(route: str, body: bytes) -> list[Answer]:
    """One answer per choice / batch item of a complete (non-streaming) response; [] when it is not JSON."""
    try:
        doc = orjson.loads(body)
    except orjson.JSONDecodeError:
        return []
    return doc_answers(route, doc)


def doc_answers(route: str, doc: Any) -> list[Answer]:
    texts = doc_texts(route, doc)
    if route == GENERATE:
        items = doc if isinstance(doc, list) else [doc]
        metas = [item.get("meta_info") if isinstance(item, dict) else None for item in items]
        tokens = [_generate_tokens(meta) for meta in metas]
        took = [_e2e_latency(meta) for meta in metas]
    else:
        choices = [c for c in (doc.get("choices") or []) if isinstance(c, dict)] if isinstance(doc, dict) else []
        parse = _chat_tokens if route == CHAT else _completion_tokens
        tokens = [parse(c.get("logprobs")) for c in choices]
        took = [None] * len(tokens)
    return [Answer(text, toks, s) for text, toks, s in zip(texts, tokens, took, strict=False)]


def _e2e_latency(meta: Any) -> float | None:
    value = meta.get("e2e_latency") if isinstance(meta, dict) else None
    if not isinstance(value, int | float) or isinstance(value, bool) or not math.isfinite(value) or value < 0:
        return None
    return float(value)


def _logprob(value: Any) -> float:
    ok = isinstance(value, int | float) and not isinstance(value, bool) and not math.isnan(value)
    return float(value) if ok else -math.inf


def _triple(entry: Any) -> Token | None:
    """SGLang's ``[logprob, token_id, text]`` (text only with ``return_text_in_logprobs``)."""
    if not isinstance(entry, list | tuple) or len(entry) < 3 or not isinstance(entry[2], str):
        return None
    return Token(entry[2], _logprob(entry[0]), token_id=entry[1] if isinstance(entry[1], int) else None)


def _generate_tokens(meta: Any) -> tuple[Token, ...] | None:
    """``meta_info.output_token_logprobs`` with ``output_top_logprobs`` (SGLang 0.5.23 ``/generate``)."""
    if not isinstance(meta, dict) or not isinstance(out := meta.get("output_token_logprobs"), list):
        return None
    tops = meta.get("output_top_logprobs")
    tokens: list[Token] = []
    for i, entry in enumerate(out):
        chosen = _triple(entry)
        if chosen is None:
            return None
        row = tops[i] if isinstance(tops, list) and i < len(tops) and isinstance(tops[i], list) else []
        tokens.append(replace(chosen, top=tuple(t for t in map(_triple, row) if t is not None)))
    return tuple(tokens)


def _chat_token(entry: Any) -> Token | None:
    if not isinstance(entry, dict) or not isinstance(text := entry.get("token"), str):
        return None
    raw = entry.get("bytes")
    exact = bytes(raw) if isinstance(raw, list) and all(isinstance(b, int) and 0 <= b < 256 for b in raw) else None
    return Token(text, _logprob(entry.get("logprob")), raw=exact)


def _chat_tokens(logprobs: Any) -> tuple[Token, ...] | None:
    """``choices[i].logprobs.content``: ``{token, logprob, bytes, top_logprobs: [{token, logprob, bytes}]}``."""
    content = logprobs.get("content") if isinstance(logprobs, dict) else None
    if not isinstance(content, list):
        return None
    tokens: list[Token] = []
    for entry in content:
        chosen = _chat_token(entry)
        if chosen is None:
            return None
        top = entry.get("top_logprobs")
        alternatives = (t for t in map(_chat_token, top if isinstance(top, list) else ()) if t is not None)
        tokens.append(replace(chosen, top=tuple(alternatives)))
    return tuple(tokens)


def _completion_tokens(logprobs: Any) -> tuple[Token, ...] | None:
    """``choices[i].logprobs``: ``{tokens, token_logprobs, top_logprobs: [{token: logprob}], text_offset}``."""
    if not isinstance(logprobs, dict):
        return None
    texts, values, tops = logprobs.get("tokens"), logprobs.get("token_logprobs"), logprobs.get("top_logprobs")
    if not isinstance(texts, list) or not isinstance(values, list) or not all(isinstance(t, str) for t in texts):
        return None
    tokens: list[Token] = []
    for i, text in enumerate(texts):
        row = tops[i] if isinstance(tops, list) and i < len(tops) and isinstance(tops[i], dict) else {}
        top = tuple(Token(k, _logprob(v)) for k, v in row.items() if isinstance(k, str))
        tokens.append(Token(text, _logprob(values[i] if i < len(values) else None), top=top))
    return tuple(tokens)


# -- comparison ----------------------------------------------------------------------------------------------------


def compare(a: Answer, b: Answer, near_tie_nats: float = NEAR_TIE_NATS) -> Verdict:
    """SAME, NUMERICAL or DIFFERENT (see the module's docstring); symmetric in ``a`` and ``b``."""
    if a.text == b.text:
        return Verdict(Kind.SAME)
    ab, bb = a.text.encode(), b.text.encode()
    d = _common_prefix(ab, bb)
    char = len(ab[:d].decode("utf-8", "ignore"))
    if a.tokens is None and b.tokens is None:
        return Verdict(Kind.DIFFERENT, char, None, "texts differ (no logprobs)")
    if a.tokens is not None and b.tokens is not None:
        return _both(ab, a.tokens, bb, b.tokens, d, char, near_tie_nats)
    if a.tokens is not None:
        return _one(ab, a.tokens, bb, d, char, near_tie_nats)
    assert b.tokens is not None
    return _one(bb, b.tokens, ab, d, char, near_tie_nats)


def _common_prefix(a: bytes, b: bytes) -> int:
    """Length of the common prefix (bisection over slice comparisons: no Python loop per byte)."""
    lo, hi = 0, min(len(a), len(b))
    while lo < hi:
        mid = (lo + hi + 1) // 2
        if a[:mid] == b[:mid]:
            lo = mid
        else:
            hi = mid - 1
    return lo


def _raws(tok: Token) -> tuple[bytes, ...]:
    """The bytes ``tok`` may stand for: its exact bytes, else its text's, else (the completions route renders a
    partial character one latin-1 char per byte) those; none for a text with U+FFFD (part of a character)."""
    if tok.raw is not None:
        return (tok.raw,)
    if "\ufffd" in tok.text:
        return ()
    out = [tok.text.encode()]
    if tok.text and max(map(ord, tok.text)) < 256 and not tok.text.isascii():
        out.append(tok.text.encode("latin-1"))
    return tuple(out)


def _align(text: bytes, tokens: tuple[Token, ...]) -> list[tuple[int, int] | None]:
    """Each token's byte span in ``text``; tokens not found as such (a part of a character, a special token the
    text leaves out) span the bytes between their neighbours; None where nothing can be placed."""
    spans: list[tuple[int, int] | None] = [None] * len(tokens)
    pos = 0
    pending: list[int] = []
    for i, tok in enumerate(tokens):
        raws = [r for r in _raws(tok) if r]
        hit = next((r for r in raws if text.startswith(r, pos)), None)
        at = pos
        if hit is None and pending and raws:  # resume after the unplaced tokens: each is a few bytes at most
            window = pos + sum(4 * len(tokens[p].text) for p in pending) + 4
            found = sorted((f, r) for r in raws if (f := text.find(r, pos, window + len(r))) >= 0)
            if found:
                at, hit = found[0]
        if hit is None:
            pending.append(i)
            continue
        for p in pending:
            spans[p] = (pos, at)
        pending.clear()
        spans[i] = (at, at + len(hit))
        pos = at + len(hit)
    for p in pending:
        spans[p] = (pos, len(text))
    return spans


def _same(x: Token, y: Token) -> bool:
    if x.token_id is not None and y.token_id is not None:
        return x.token_id == y.token_id
    if x.raw is not None and y.raw is not None:
        return x.raw == y.raw
    return x.text == y.text


def _is_end(tok: Token) -> bool:
    """An end of sequence: an empty rendering (a special token skipped; the simulator's EOS) or an end marker's
    text (``<|im_end|>``, ``</s>``, ``[EOS]``, ...)."""
    return (tok.text == "" and not tok.raw) or tok.text in END_MARKERS


def _runner_ups(step: Token, near_tie_nats: float) -> Iterable[Token]:
    """The step's two most likely tokens other than the one it chose, within ``near_tie_nats`` of the top-1."""
    candidates = [step, *(t for t in step.top if not _same(t, step))]
    candidates.sort(key=lambda t: t.logprob, reverse=True)
    best = candidates[0].logprob
    close = [t for t in candidates[:2] if math.isfinite(t.logprob) and best - t.logprob <= near_tie_nats]
    return [t for t in close if t is not step]


def _near_tie(step: Token, other: Token, near_tie_nats: float) -> bool:
    return any(_same(t, other) for t in _runner_ups(step, near_tie_nats))


def _one(xb: bytes, tokens: tuple[Token, ...], yb: bytes, d: int, char: int, near_tie_nats: float) -> Verdict:
    """Only one side has logprobs: some token of it whose span or near-tied runner-up's holds the first differing
    byte, with the other text going on with that runner-up (or ending, for an end-of-sequence runner-up)."""
    for j, (tok, span) in enumerate(zip(tokens, _align(xb, tokens), strict=True)):
        if span is None:
            continue
        start, end = span
        if start > d:
            break
        for alt in _runner_ups(tok, near_tie_nats):
            if _is_end(alt):
                matched = start == d == len(yb)
            else:
                matched = any(yb.startswith(r, start) and d < start + max(len(r), end - start) for r in _raws(alt) if r)
            if matched:
                top1 = max(t.logprob for t in (tok, *tok.top))
                why = f"token {j}: {tok.text!r} chosen over {alt.text!r}, {top1 - alt.logprob:.3f} nats behind"
                return Verdict(Kind.NUMERICAL, char, j, why)
    return Verdict(Kind.DIFFERENT, char, _holding(tokens, xb, d), "the other text is not this answer's near-tie")


def _holding(tokens: tuple[Token, ...], text: bytes, d: int) -> int | None:
    spans = _align(text, tokens)
    return next((i for i, s in enumerate(spans) if s is not None and s[0] <= d < max(s[1], s[0] + 1)), None)


def _both(
    ab: bytes, at: tuple[Token, ...], bb: bytes, bt: tuple[Token, ...], d: int, char: int, near_tie_nats: float
) -> Verdict:
    """Both sides have logprobs: at the first token where they part, each side's token is the other's near-tied
    runner-up (or, where one side ran out of tokens, the other's runner-up there ends the sequence)."""
    k = next((i for i, (x, y) in enumerate(zip(at, bt, strict=False)) if not _same(x, y)), min(len(at), len(bt)))
    sa, sb = _align(ab, at), _align(bb, bt)
    if k == len(at) and k == len(bt):
        return Verdict(Kind.DIFFERENT, char, _holding(at, ab, d), "texts differ where their tokens agree")
    if k == len(at) or k == len(bt):  # one answer stopped without an end token: the other's top two must end here
        longer, spans, short = (bt, sb, ab) if k == len(at) else (at, sa, bb)
        span = spans[k]
        ends = any(map(_is_end, _runner_ups(longer[k], near_tie_nats)))
        if span is not None and span[0] == d == len(short) and ends:
            return Verdict(Kind.NUMERICAL, char, k, f"token {k}: {longer[k].text!r} near-tied with an end")
        return Verdict(Kind.DIFFERENT, char, k, f"one answer stops at token {k} where the other's top two do not end")
    x, y, span_a, span_b = at[k], bt[k], sa[k], sb[k]
    if span_a is None or span_b is None or span_a[0] != span_b[0] or span_a[0] > d:
        return Verdict(Kind.DIFFERENT, char, k, f"texts differ before their tokens do (token {k})")
    if _near_tie(x, y, near_tie_nats) and _near_tie(y, x, near_tie_nats):
        return Verdict(Kind.NUMERICAL, char, k, f"token {k}: {x.text!r} / {y.text!r}, each the other's near-tie")
    return Verdict(Kind.DIFFERENT, char, k, f"token {k}: {x.text!r} / {y.text!r} are not near-tied")
