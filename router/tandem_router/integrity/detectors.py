"""Cheap detectors for garbled output, run on every response (purely computational).

The signatures come from the upstream decode KV-offload races: a request whose prompt KV slots were reused by
another request "attends" to the other request's prompt and emits long substrings of it, often collapsing
into a repetition loop. Both are visible in the text alone:

- ``PromptLeakIndex``: long word n-grams of *other* recent requests' prompts appearing in an output (and not in
  the request's own prompt). An index of n-gram hashes keeps each check O(output length).
- ``find_repetition_loop``: the output's tail is one short phrase repeated many times.
- ``find_bad_text``: replacement characters (invalid UTF-8 upstream), control characters, leaked special
  tokens.

Every detector judges the output against the request's *own* prompt: characters, n-grams and repeated phrases
that were in the prompt are not evidence (a client can always ask for them to be repeated).
"""

from __future__ import annotations

import re
from collections import OrderedDict
from dataclasses import dataclass
from enum import StrEnum

_WORD = re.compile(r"\S+")
_CONTROL = re.compile(r"[\x00-\x08\x0b\x0c\x0e-\x1f\x7f]")
_SPECIAL_TOKEN = re.compile(r"<\|[a-z_]{2,32}\|>|\[(?:BOS|EOS|PAD|UNK)\]|</?s>")


class Finding(StrEnum):
    PROMPT_LEAK = "prompt_leak"
    REPETITION_LOOP = "repetition_loop"
    BAD_TEXT = "bad_text"


@dataclass(frozen=True)
class Detection:
    finding: Finding
    detail: str
    sources: frozenset[str] = frozenset()  # prompt leak: the requests whose prompts leaked


def words(text: str) -> list[str]:
    return _WORD.findall(text)


def _ngram_hashes(tokens: list[str], n: int) -> set[int]:
    return {hash(tuple(tokens[i : i + n])) for i in range(len(tokens) - n + 1)}


class PromptLeakIndex:
    """N-gram index of the prompts of in-flight and recently finished requests.

    ``add`` a prompt when its request starts, ``check`` an output against every *other* prompt, ``discard``
    when the request is old enough that its KV slots can no longer be confused with live ones. Bounded by
    ``max_prompts`` (oldest dropped first), so memory stays flat under any load.
    """

    def __init__(self, ngram: int = 8, max_prompts: int = 4096) -> None:
        if ngram < 2:
            raise ValueError("ngram must be >= 2")
        self.ngram = ngram
        self.max_prompts = max_prompts
        self._prompts: OrderedDict[str, set[int]] = OrderedDict()
        self._owners: dict[int, set[str]] = {}

    def __len__(self) -> int:
        return len(self._prompts)

    def add(self, request_id: str, prompt: str) -> None:
        if request_id in self._prompts:
            self.discard(request_id)
        grams = _ngram_hashes(words(prompt), self.ngram)
        self._prompts[request_id] = grams
        for gram in grams:
            self._owners.setdefault(gram, set()).add(request_id)
        while len(self._prompts) > self.max_prompts:
            self.discard(next(iter(self._prompts)))

    def discard(self, request_id: str) -> None:
        grams = self._prompts.pop(request_id, None)
        for gram in grams or ():
            owners = self._owners.get(gram)
            if owners is not None:
                owners.discard(request_id)
                if not owners:
                    del self._owners[gram]

    def check(self, request_id: str, prompt: str, output: str) -> Detection | None:
        """A leak if some n-gram of ``output`` is in another indexed prompt but not in this request's prompt."""
        out_tokens = words(output)
        if len(out_tokens) < self.ngram:
            return None
        own = self._prompts.get(request_id)
        if own is None:
            own = _ngram_hashes(words(prompt), self.ngram)
        for i in range(len(out_tokens) - self.ngram + 1):
            gram = hash(tuple(out_tokens[i : i + self.ngram]))
            if gram in own:
                continue
            owners = self._owners.get(gram)  # no set built per n-gram unless another request owns it
            if owners and (len(owners) > 1 or request_id not in owners):
                phrase = " ".join(out_tokens[i : i + self.ngram])
                return Detection(
                    Finding.PROMPT_LEAK,
                    f"output repeats another request's prompt: {phrase!r}",
                    frozenset(owners - {request_id}),
                )
        return None


def _contains(haystack: list[str], needle: list[str]) -> bool:
    n = len(needle)
    return any(haystack[i : i + n] == needle for i in range(len(haystack) - n + 1))


def find_repetition_loop(
    text: str, max_period: int = 16, min_repeats: int = 4, min_span_words: int = 24, prompt: str = ""
) -> Detection | None:
    """A loop if the output's last words are one phrase of <= ``max_period`` words repeated ``min_repeats``+
    times and spanning at least ``min_span_words`` words, and that phrase is not in the prompt."""
    tokens = words(text)
    n = len(tokens)
    for period in range(1, max_period + 1):
        if n < period * min_repeats:
            break
        unit = tokens[n - period :]
        repeats = 1
        pos = n - 2 * period
        while pos >= 0 and tokens[pos : pos + period] == unit:
            repeats += 1
            pos -= period
        if repeats >= min_repeats and repeats * period >= min_span_words:
            if _contains(words(prompt), unit):  # the prompt's words only when there is a loop
                return None  # the prompt's own phrase (longer periods are the same loop)
            return Detection(
                Finding.REPETITION_LOOP, f"last {repeats * period} words repeat {' '.join(unit)!r} x{repeats}"
            )
    return None


def find_bad_text(text: str, prompt: str = "") -> Detection | None:
    """Replacement characters, control characters or special tokens in the output that the prompt did not have."""
    if "\ufffd" in text and "\ufffd" not in prompt:
        return Detection(Finding.BAD_TEXT, "replacement character (invalid UTF-8 from the model)")
    for control in _CONTROL.finditer(text):
        if control.group() not in prompt:
            return Detection(Finding.BAD_TEXT, f"control character {control.group()!r}")
    for special in _SPECIAL_TOKEN.finditer(text):
        if special.group() not in prompt:
            return Detection(Finding.BAD_TEXT, f"special token {special.group()!r} in output")
    return None
