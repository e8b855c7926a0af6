"""The simulated model (pure): surface words live in the KV bytes, clean output never trips the router's integrity
detectors, and foreign KV makes the output repeat the foreign prompt's real words."""

from __future__ import annotations

import random

import numpy as np
import pytest

from tandem_router.integrity.detectors import PromptLeakIndex, find_bad_text, find_repetition_loop
from tandem_sim.model import model

W = model.weights(0, 256)


def _words(rng: random.Random, n: int) -> list[str]:
    letters = "abcdefghijklmnopqrstuvwxyz"
    pool = ["the", "of", "and", "to", "in", "über", "naïve", "東京", "x" * 70, *model.vocabulary()[1024:1100]]
    return [
        rng.choice(pool) if rng.random() < 0.3 else "".join(rng.choice(letters) for _ in range(rng.randint(2, 10)))
        for _ in range(n)
    ]


def _generate(prompt: model.Tokens, params: model.SamplingParams, store: np.ndarray | None = None) -> list[str]:
    """Run the decoder over a flat KV store (position p in row p), writing each new token's KV as the engine does."""
    if store is None:
        store = np.zeros((len(prompt.ids) + params.max_new_tokens, W.kv_bytes), dtype=np.uint8)
        store[: len(prompt.ids)] = model.compute_kv(W, prompt)
    decoder = model.Decoder(W, len(prompt.ids), params, lambda start, count: store[start : start + count].copy())
    words: list[str] = []
    for _ in range(params.max_new_tokens):
        token, word = decoder.next_token()
        if token == model.EOS_ID:
            break
        store[decoder.length - 1] = model.compute_kv(W, model.Tokens([token], [word]), decoder.length - 1)[0]
        words.append(word)
    return words


def test_kv_roundtrip_keeps_the_real_word() -> None:
    words = ["hello", "über", "東京", "kala", "y" * (W.surface_capacity + 1)]
    tokens = model.tokenize(" ".join(words))
    kv = model.compute_kv(W, tokens, 7)
    for i, row in enumerate(kv):
        slot = model.read_slot(W, row.tobytes())
        assert slot.token == tokens.ids[i]
        assert slot.position == 7 + i
        expected = words[i] if len(words[i].encode()) <= W.surface_capacity else model.vocabulary()[tokens.ids[i]]
        assert slot.word == expected
        assert np.array_equal(model.compute_kv(W, model.Tokens([tokens.ids[i]], [words[i]]), 7 + i)[0], row)
    # Another seed ("other weights") cannot read the words back.
    assert model.read_slot(model.weights(1, 256), kv[0].tobytes()).word != "hello"


INVISIBLE_WORDS = ["zero\u200bwidth", "bell\x07", "rtl\u202eword", "e\u0301", "esc\x1b[0m", "\ufeffbom", "🙂", "\x00"]


def test_prompt_words_come_back_exactly_as_sglang_detokenizes_them() -> None:
    """SGLang decodes valid UTF-8 to exactly its characters: copying a word with an invisible or control character
    out of the prompt reproduces it, never U+FFFD (issue 19 item 2)."""
    tokens = model.tokenize(" ".join(INVISIBLE_WORDS))
    assert tokens.words == INVISIBLE_WORDS  # none of these is whitespace to str.split
    for i, row in enumerate(model.compute_kv(W, tokens)):
        assert model.read_slot(W, row.tobytes()).word == INVISIBLE_WORDS[i]
    copied: set[str] = set()
    for seed in range(40):
        params = model.SamplingParams(max_new_tokens=64, ignore_eos=True, sampling_seed=seed)
        words = _generate(tokens, params)
        assert "\ufffd" not in " ".join(words)
        copied |= set(words) & set(INVISIBLE_WORDS)
    assert len(copied) >= 4, copied


def test_whitespace_only_text_is_one_token_and_empty_text_none() -> None:
    assert model.tokenize("\n \t").words == ["\n \t"]
    assert model.tokenize("").ids == []


def test_only_invalid_utf8_detokenizes_to_the_replacement_character() -> None:
    assert model.detokenize("zero\u200bwidth".encode()) == "zero\u200bwidth"
    assert model.detokenize(b"ab\xffcd") == "ab\ufffdcd"
    assert model.detokenize("東".encode()[:2]) == "\ufffd"


def test_kv_bytes_minimum() -> None:
    with pytest.raises(ValueError, match="kv_bytes must be >= 64"):
        model.weights(0, model.MIN_KV_BYTES - 1)


def test_closes_loop() -> None:
    assert model.closes_loop(["a", "b", "a", "b", "a", "b"])
    assert model.closes_loop(["x", "a", "a", "a"])
    assert not model.closes_loop(["a", "b", "a", "b", "a", "c"])
    assert not model.closes_loop(["a", "a"])


@pytest.mark.timeout(120)
def test_clean_outputs_never_trip_the_integrity_detectors() -> None:
    """Many random prompts and sampling params: no repetition loop, no 8-word run of another prompt, no bad text,
    and every output is deterministic."""
    rng = random.Random(11)
    cases = []
    for i in range(400):
        text = " ".join(_words(rng, rng.choice([1, 2, 5, rng.randint(1, 120)])))
        params = model.SamplingParams(
            max_new_tokens=rng.choice([1, 16, 64, 200]),
            temperature=rng.choice([0.0, 0.7, 1.0]),
            ignore_eos=rng.random() < 0.5,
            sampling_seed=rng.choice([None, i]),
        )
        cases.append((str(i), text, params))
    index = PromptLeakIndex()
    for rid, text, _ in cases:
        index.add(rid, text)
    total = 0
    for rid, text, params in cases:
        words = _generate(model.tokenize(text), params)
        output = " ".join(words)
        total += len(words)
        assert find_repetition_loop(output) is None, (text, output)
        assert find_bad_text(output) is None, (text, output)
        assert index.check(rid, text, output) is None, (text, output)
        assert _generate(model.tokenize(text), params) == words
    assert total > 10_000


def test_foreign_kv_repeats_the_foreign_prompts_real_words() -> None:
    """Slot reuse: the request's prompt slots hold another prompt's KV (computed for other positions). The output
    collapses into the foreign prompt's actual words, which the router's leak and loop detectors both see."""
    rng = random.Random(5)
    detected = 0
    for i in range(40):
        own = " ".join(_words(rng, 40))
        foreign_words = [f"foreign{i}w{j}" for j in range(60)]
        params = model.SamplingParams(max_new_tokens=48, ignore_eos=True, temperature=1.0)
        prompt = model.tokenize(own)
        store = np.zeros((len(prompt.ids) + params.max_new_tokens, W.kv_bytes), dtype=np.uint8)
        store[: len(prompt.ids)] = model.compute_kv(W, prompt)
        decoder_view = store  # the reuse happens after admission: foreign KV at shifted positions
        clean = _generate(prompt, params)
        decoder_view[:40] = model.compute_kv(W, model.tokenize(" ".join(foreign_words)), 17)[:40]
        garbled = _generate(prompt, params, decoder_view)
        assert garbled != clean
        assert set(garbled) & set(foreign_words), garbled
        index = PromptLeakIndex()
        index.add("own", own)
        index.add("other", " ".join(foreign_words))
        output = " ".join(garbled)
        if index.check("own", own, output) is not None and find_repetition_loop(output) is not None:
            detected += 1
    assert detected >= 30, detected


@pytest.mark.parametrize("seed", range(20))
def test_a_stream_resumed_with_its_text_appended_continues_token_for_token(seed: int) -> None:
    """What the router's resume relies on: prefilling prompt + generated words and decoding on gives the rest of
    the uninterrupted generation (the decoder's state is a function of the context, as a model's is)."""
    rng = random.Random(seed)
    prompt = model.tokenize(model.apply_chat_template([("user", " ".join(_words(rng, 40)))]))
    params = model.SamplingParams(max_new_tokens=60, temperature=0.0, sampling_seed=seed)
    whole = _generate(prompt, params)
    cut = rng.randint(1, max(1, len(whole) - 1))
    resumed_prompt = model.tokenize(" ".join([*prompt.words, *whole[:cut]]))
    rest = _generate(resumed_prompt, model.SamplingParams(max_new_tokens=60 - cut, temperature=0.0, sampling_seed=seed))
    assert whole[:cut] + rest == whole
