"""What the fleet's workers answer (``fleet_workers``), pure: a clean answer as a function of the prompt alone, and
its bodies and SSE events in SGLang's ``/generate`` and OpenAI's shapes, with top-2 logprobs when asked for."""

from __future__ import annotations

import hashlib
import random
from typing import Any

import orjson

from tandem_dev.router.instant_worker import MODEL

MARGIN = 3.0  # nats between a token and its runner-up: far above the router's 0.5-nat near-tie
DEFAULT_TOKENS = 32
# 96 made-up words for the answers (the bench prompts are other syllables, so no answer repeats a prompt by chance)
VOCAB = tuple(
    a + b + c
    for a in ("cho", "shu", "quo", "wyx", "jeh", "yul", "xim", "wha")
    for b in ("lan", "rik", "tov")
    for c in ("", "ge", "ri", "ot")
)


def prompt_seed(prompt: list[str]) -> int:
    return int.from_bytes(hashlib.blake2b(" ".join(prompt).encode(), digest_size=8).digest(), "little")


def clean_words(prompt: list[str], tokens: int) -> list[str]:
    """The clean answer: a function of the prompt alone, so every clean pair answers a request alike."""
    rng = random.Random(prompt_seed(prompt))
    return [VOCAB[rng.randrange(len(VOCAB))] for _ in range(tokens)]


def token(word: str) -> tuple[list[Any], list[list[Any]]]:
    """SGLang's ``[logprob, token_id, text]`` of a token and its top two (the runner-up ``MARGIN`` nats behind)."""
    chosen = VOCAB.index(word) if word in VOCAB else len(VOCAB) + prompt_seed([word]) % 50000
    runner = VOCAB[(chosen + 1) % len(VOCAB)]
    first = [-0.05, chosen, f" {word}"]
    return first, [first, [-0.05 - MARGIN, (chosen + 1) % len(VOCAB), f" {runner}"]]


def prompt(path: str, body: dict[str, Any]) -> list[str] | None:
    if path == "/v1/chat/completions":
        messages = body.get("messages")
        if not isinstance(messages, list):
            return None
        return " ".join(str(m.get("content", "")) for m in messages if isinstance(m, dict)).split()
    text = body.get("prompt" if path == "/v1/completions" else "text")
    return text.split() if isinstance(text, str) else None


def budget(path: str, body: dict[str, Any]) -> int:
    if path == "/generate":
        params = body.get("sampling_params") or {}
        value = params.get("max_new_tokens") if isinstance(params, dict) else None
    else:
        value = body.get("max_completion_tokens") or body.get("max_tokens")
    return value if isinstance(value, int) and 0 < value <= 4096 else DEFAULT_TOKENS


def logprobs_asked(path: str, body: dict[str, Any]) -> bool:
    return bool(body.get("return_logprob") if path == "/generate" else body.get("logprobs"))


def full_body(path: str, words: list[str], prompt_len: int, logprobs: bool, e2e_latency: float = 0.0) -> bytes:
    """A complete answer; on ``/generate`` with ``meta_info.e2e_latency`` (SGLang's seconds from the request's
    arrival at the worker to its end, ``TokenizerManager._handle_batch_output``)."""
    text = "".join(f" {w}" for w in words)
    usage = {"prompt_tokens": prompt_len, "completion_tokens": len(words), "total_tokens": prompt_len + len(words)}
    pairs = [token(w) for w in words] if logprobs else []
    if path == "/generate":
        meta: dict[str, Any] = {
            "prompt_tokens": prompt_len,
            "completion_tokens": len(words),
            "finish_reason": {"type": "length", "length": len(words)},
            "e2e_latency": e2e_latency,
        }
        if logprobs:
            meta["output_token_logprobs"] = [first for first, _ in pairs]
            meta["output_top_logprobs"] = [top for _, top in pairs]
        return orjson.dumps({"text": text, "meta_info": meta})
    if path == "/v1/chat/completions":
        choice: dict[str, Any] = {
            "index": 0,
            "message": {"role": "assistant", "content": text},
            "finish_reason": "length",
        }
        if logprobs:
            content = [
                {"token": t[2], "logprob": t[0], "bytes": list(t[2].encode()),
                 "top_logprobs": [{"token": a[2], "logprob": a[0], "bytes": list(a[2].encode())} for a in top]}
                for t, top in pairs
            ]  # fmt: skip
            choice["logprobs"] = {"content": content}
        kind = "chat.completion"
    else:
        choice = {"index": 0, "text": text, "finish_reason": "length"}
        if logprobs:
            offsets = [sum(len(w) + 1 for w in words[:i]) for i in range(len(words))]
            choice["logprobs"] = {
                "tokens": [t[2] for t, _ in pairs], "token_logprobs": [t[0] for t, _ in pairs],
                "top_logprobs": [{a[2]: a[0] for a in top} for _, top in pairs], "text_offset": offsets,
            }  # fmt: skip
        kind = "text_completion"
    doc = {"id": "fleet", "object": kind, "created": 0, "model": MODEL, "choices": [choice], "usage": usage}
    return orjson.dumps(doc)


def chunk(path: str, words: list[str], i: int) -> bytes:
    """The SSE event of token ``i``: cumulative text on ``/generate`` (SGLang's default), deltas on OpenAI routes."""
    last = i == len(words) - 1
    finish = "length" if last else None
    if path == "/generate":
        meta: dict[str, Any] = {"completion_tokens": i + 1}
        if last:
            meta["finish_reason"] = {"type": "length", "length": len(words)}
        doc: dict[str, Any] = {"text": "".join(f" {w}" for w in words[: i + 1]), "meta_info": meta}
    elif path == "/v1/chat/completions":
        choice = {"index": 0, "delta": {"content": f" {words[i]}"}, "finish_reason": finish}
        doc = {"id": "fleet", "object": "chat.completion.chunk", "model": MODEL, "choices": [choice]}
    else:
        choice = {"index": 0, "text": f" {words[i]}", "finish_reason": finish}
        doc = {"id": "fleet", "object": "text_completion", "model": MODEL, "choices": [choice]}
    return b"data: " + orjson.dumps(doc) + b"\n\n"
