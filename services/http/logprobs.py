"""Logprobs in OpenAI's two shapes, from Baton's `Logprobs` (token ids and values).

    completions  {"tokens": [...], "token_logprobs": [...], "top_logprobs": [{token: lp}, ...],
                  "text_offset": [...]}       the legacy shape; with `echo` the prompt's tokens come
                                              first, the very first with null (nothing predicts it)
    chat         {"content": [{"token", "logprob", "bytes", "top_logprobs": [{"token", "logprob",
                  "bytes"}, ...]}, ...]}

A token's string is its own decoding; `bytes` are its raw bytes (a byte-level BPE token may hold
part of a UTF-8 character, whose string is then U+FFFD while its bytes stay exact). As in vLLM, a
completions `top_logprobs` map holds the chosen token as well as the `logprobs` most likely ones.
The frontend decodes token ids itself, from the model directory's tokenizer (loaded on the first
request that asks for logprobs), so the wire carries ids only.
"""
from __future__ import annotations

from functools import cached_property
from pathlib import Path

from baton.proto.public import Logprobs
from baton.shared.model.tokenizer import TextTokenizer


class Vocab:
    """Token id -> its string and raw bytes, for one model's tokenizer."""

    def __init__(self, model_dir: str | Path) -> None:
        self.tokenizer = TextTokenizer.load(model_dir)
        self._texts: dict[int, str] = {}

    def text(self, token_id: int) -> str:
        if token_id not in self._texts:
            self._texts[token_id] = self.tokenizer.decode([token_id])
        return self._texts[token_id]

    def raw_bytes(self, token_id: int) -> list[int]:
        piece = self.tokenizer.id_to_token(token_id)
        if piece is not None and all(ch in self._byte_of for ch in piece):
            return [self._byte_of[ch] for ch in piece]
        return list(self.text(token_id).encode())  # a special token: its literal text

    @cached_property
    def _byte_of(self) -> dict[str, int]:
        """GPT-2's byte-level alphabet, inverted: the printable character that stands for each byte
        (printable bytes stand for themselves, the other 68 for U+0100 onwards, in byte order)."""
        printable = [*range(ord("!"), ord("~") + 1), *range(ord("¡"), ord("¬") + 1), *range(ord("®"), ord("ÿ") + 1)]
        others = [b for b in range(256) if b not in printable]
        return {**{chr(b): b for b in printable}, **{chr(256 + i): b for i, b in enumerate(others)}}


def completion_logprobs(vocab: Vocab, logprobs: Logprobs, offset: int, prompt_first: int | None = None) -> dict:
    """The legacy shape for `logprobs`, text offsets from `offset`; `prompt_first`: the prompt's
    first token when the prompt is echoed (it leads, with null values)."""
    tokens, values, tops = [], [], []
    if prompt_first is not None:
        tokens, values, tops = [vocab.text(prompt_first)], [None], [None]
    for token, value, top_ids, top_values in zip(logprobs.token_ids, logprobs.logprobs, logprobs.top_ids,
                                                 logprobs.top_logprobs):
        tokens.append(vocab.text(token))
        values.append(value)
        top = {vocab.text(t): v for t, v in zip(top_ids, top_values)}
        top.setdefault(vocab.text(token), value)
        tops.append(top)
    offsets = []
    for token in tokens:
        offsets.append(offset)
        offset += len(token)
    return {"tokens": tokens, "token_logprobs": values, "top_logprobs": tops, "text_offset": offsets}


def chat_logprobs(vocab: Vocab, logprobs: Logprobs) -> dict:
    def entry(token: int, value: float) -> dict:
        return {"token": vocab.text(token), "logprob": value, "bytes": vocab.raw_bytes(token)}
    return {"content": [{**entry(token, value), "top_logprobs": [entry(t, v) for t, v in zip(top_ids, top_values)]}
                        for token, value, top_ids, top_values in zip(logprobs.token_ids, logprobs.logprobs,
                                                                     logprobs.top_ids, logprobs.top_logprobs)]}
