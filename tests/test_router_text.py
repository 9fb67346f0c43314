"""TextStream: incremental detokenization with stop strings, against the real tokenizer."""
from __future__ import annotations

import random

import pytest

from baton.services.router.text import REPLACEMENT, TextStream
from baton.shared.model.checkpoint import DEFAULT_MODEL_DIR
from baton.shared.model.heldout import HELDOUT_TEXT
from baton.shared.model.tokenizer import TextTokenizer

pytestmark = pytest.mark.unit

TEXTS = [
    "To be, or not to be, that is the question:",
    "naïve café, crème brûlée, Ångström, façade, jalapeño",
    "日本語のテキストと中文的文本，还有한국어 문장도 있어요。",
    "emoji 🎉🚀 and a family 👨‍👩‍👧‍👦, flags 🇫🇷🇯🇵, skin tone 👍🏽!",
    "mixed: α≈β → ∞ ≠ 0; “quotes” — dash… e\u0301 (combining) 𝔘𝔫𝔦𝔠𝔬𝔡𝔢",
    "Line one\n\nLine two, ünïcödé\n\n\tthe end 🌍",
]


@pytest.fixture(scope="module")
def tok() -> TextTokenizer:
    return TextTokenizer.load("models/baton-tiny")


def chunks(ids: list[int], rng: random.Random, most: int = 6) -> list[list[int]]:
    out, i = [], 0
    while i < len(ids):
        n = rng.randint(1, most)
        out.append(ids[i:i + n])
        i += n
    return out


def stream(tok, ids: list[int], stop: list[str], rng: random.Random,
           split: list[list[int]] | None = None) -> tuple[TextStream, list[int], list[str]]:
    s, got, pieces = TextStream(tok, stop), [], []
    for chunk in split or chunks(ids, rng):
        out, delta = s.add(chunk)
        got += out
        pieces.append(delta)
    pieces.append(s.finish())
    return s, got, pieces


def test_multibyte_characters_are_split_across_tokens(tok):
    """What the streaming tests rely on: this tokenizer cuts characters into single bytes."""
    for text in TEXTS[1:]:
        assert any(REPLACEMENT in tok.decode([i]) for i in tok.encode(text))


@pytest.mark.parametrize("seed", range(20))
def test_stream_equals_decode_of_all_tokens(tok, seed):
    rng = random.Random(seed)
    for text in TEXTS:
        ids = tok.encode(text)
        s, got, pieces = stream(tok, ids, [], rng)
        assert "".join(pieces) == tok.decode(ids) == text and got == ids and not s.stopped
        assert not any(REPLACEMENT in p for p in pieces)


def test_invalid_utf8_still_round_trips(tok):
    """Byte tokens that never form a character: the text ends as decode() has it, U+FFFD and all."""
    rng = random.Random(7)
    byte_ids = [i for i in range(tok.vocab_size) if tok.decode([i]) == REPLACEMENT]
    for _ in range(50):
        ids = [rng.choice(byte_ids + tok.encode("ab é")) for _ in range(rng.randint(1, 30))]
        _, _, pieces = stream(tok, ids, [], rng)
        assert "".join(pieces) == tok.decode(ids)


@pytest.mark.parametrize("seed", range(20))
def test_stop_string_cuts_the_text(tok, seed):
    """A stop string anywhere (multi-byte ones too, and right after a split character): the text
    stops just before its first occurrence and no later token is reported."""
    rng = random.Random(seed)
    for text in TEXTS:
        ids = tok.encode(text)
        start = rng.randrange(len(text) - 1)
        stop = text[start:start + rng.randint(1, 4)]
        split = chunks(ids, rng)
        s, got, pieces = stream(tok, ids, ["never there", stop], rng, split)
        assert s.stopped and "".join(pieces) == text[:text.find(stop)]
        upto = next(n for n in range(1, len(split) + 1) if stop in tok.decode(sum(split[:n], [])))
        assert got == sum(split[:upto], [])  # up to the chunk that completed the stop string


def first_stop_after(tok, ids: list[int], stop: str, min_tokens: int) -> int | None:
    """Where the first `stop` that ends in the text of a token after the first min_tokens begins."""
    text, floor = tok.decode(ids), len(tok.decode(ids[:min_tokens]).removesuffix(REPLACEMENT))
    return next((i for i in range(len(text)) if text.startswith(stop, i) and i + len(stop) > floor), None)


@pytest.mark.parametrize("seed", range(20))
def test_min_tokens_delays_stop_strings_whatever_the_chunks(tok, seed):
    """A stop string that ends in the text of the first min_tokens tokens is not matched; the first
    one ending later cuts the text; the outcome does not depend on how tokens come in chunks."""
    rng = random.Random(seed)
    for text in TEXTS:
        ids = tok.encode(text)
        start = rng.randrange(len(text) - 1)
        stop, min_tokens = text[start:start + rng.randint(1, 3)], rng.randrange(len(ids) + 1)
        cut = first_stop_after(tok, ids, stop, min_tokens)
        for split in (chunks(ids, rng), [ids], [[t] for t in ids]):
            s, pieces = TextStream(tok, [stop], min_tokens=min_tokens), []
            pieces = [s.add(chunk)[1] for chunk in split] + [s.finish()]
            assert (s.stopped, "".join(pieces)) == (cut is not None, text[:cut]), (stop, min_tokens, split)


def test_min_tokens_passes_a_stop_string_in_its_first_tokens(tok):
    ids = tok.encode("one\n\ntwo\n\nthree")
    first = next(n for n in range(len(ids)) if "\n\n" in tok.decode(ids[:n]))  # tokens up to the first stop
    for min_tokens, text in ((0, "one"), (first - 1, "one"), (first, "one\n\ntwo"), (len(ids), "one\n\ntwo\n\nthree")):
        s = TextStream(tok, ["\n\n"], min_tokens=min_tokens)
        assert s.add(ids)[1] + s.finish() == text, min_tokens


def test_stop_prefix_is_held_back_until_it_is_known(tok):
    s = TextStream(tok, [" have"])
    ids = tok.encode("we hav")
    assert "".join(s.add([i])[1] for i in ids) == "we"  # " hav" may still become " have"
    assert s.finish() == " hav" and not s.stopped
    s = TextStream(tok, ["\n\n"])
    assert "".join(s.add([i])[1] for i in tok.encode("one\n\ntwo")) == "one" and s.stopped
    assert s.add(tok.encode("more")) == ([], "") and s.finish() == ""


def old_text_stream(tok, stop):
    """The former implementation (decodes every token at every chunk), as the reference."""
    class Old(TextStream):
        def add(self, token_ids):
            if self.stopped:
                return [], ""
            self.tokens.extend(token_ids)
            text = self.tokenizer.decode(self.tokens)
            cut = self._stop_at(text)
            if cut is not None:
                self.stopped = True
                return token_ids, self._release(text[:cut])
            return token_ids, self._release(text[:len(text) - self._holdback(text)])

        def finish(self):
            return "" if self.stopped else self._release(self.tokenizer.decode(self.tokens))
    return Old(tok, stop)


@pytest.mark.parametrize("seed", range(10))
def test_same_outcome_as_decoding_everything(tok, seed):
    """Several ASCII stop strings: the same tokens, text and stop as decoding all tokens each time."""
    rng = random.Random(seed)
    for text in TEXTS:
        ids, stop = tok.encode(text), rng.sample([" the", "e,", "\n\n", "🎉", "ü", "xyz", "文本", ", "], 3)
        new, old = TextStream(tok, stop), old_text_stream(tok, stop)
        want, got = [], []
        for chunk in chunks(ids, rng):
            got.append(new.add(chunk))
            want.append(old.add(chunk))
        assert [t for t, _ in got] == [t for t, _ in want] and new.stopped == old.stopped
        assert "".join(d for _, d in got) + new.finish() == "".join(d for _, d in want) + old.finish()


class CountingTokenizer:
    def __init__(self, tok: TextTokenizer) -> None:
        self.tok, self.decoded = tok, 0

    def decode(self, ids: list[int]) -> str:
        self.decoded += len(ids)
        return self.tok.decode(ids)


@pytest.mark.parametrize("most", [1, 8])
def test_decoding_work_is_linear(tok, most):
    ids = (tok.encode(" ".join(TEXTS)) * 40)[:2000]
    counting = CountingTokenizer(tok)
    s, pieces = TextStream(counting, ["never there", "\n\n\n"]), []
    for chunk in chunks(ids, random.Random(most), most):
        pieces.append(s.add(chunk)[1])
    pieces.append(s.finish())
    assert "".join(pieces) == tok.decode(ids)
    assert counting.decoded < 20 * len(ids), counting.decoded  # decoding all each time: ~n^2 / (2 * chunk)
    assert len(s.window) < 50


@pytest.mark.parametrize("seed", range(5))
def test_a_stop_token_is_reported_without_its_text(tok, seed):
    """End of text and `stop_token_ids` end generation; like vLLM, their text is left out, in the
    reply and in every stream piece, while the token id is still reported."""
    rng = random.Random(seed)
    for text in TEXTS:
        ids = tok.encode(text)
        for stop_id in {tok.eos_token_id, ids[-1]} - set(ids[:-1]):  # generation ends at its first stop token
            s = TextStream(tok, [], frozenset({stop_id}))
            got, pieces = [], []
            for chunk in chunks(ids[:-1] + [stop_id], rng):
                out, delta = s.add(chunk)
                got += out
                pieces.append(delta)
            pieces.append(s.finish())
            assert got == ids[:-1] + [stop_id] and "".join(pieces) == tok.decode(ids[:-1])
            assert not any("<|endoftext|>" in p for p in pieces)


def test_min_tokens_is_a_lower_bound_on_the_token_count():
    tok = TextTokenizer.load(DEFAULT_MODEL_DIR)
    text = HELDOUT_TEXT.read_text()[:20_000]
    samples = [text[i:i + n] for i, n in ((0, 1), (7, 100), (500, 4000), (0, 20_000))]
    samples += ["<|endoftext|>" * 50, "é" * 300, "🙂" * 200, " " * 1000, ""]
    for s in samples:
        assert tok.min_tokens(s) <= len(tok.encode(s)), s[:40]
    assert tok.min_tokens("x" * 240_000) >= 240_000 // tok.max_token_bytes
