"""Incremental detokenization with stop strings, for the router's replies.

Text is only released once it can no longer change: a trailing partial UTF-8 character (the
byte-level BPE decodes it as U+FFFD) and any tail that could still become a stop string are held
back until the next tokens or the end.

Decoding is incremental, as in vLLM and TGI, so a request costs O(n) rather than O(n^2): `read` is
how many tokens have settled text (their decoding ended on a whole character) and `prefix` (<= read)
is where the settled tokens of the step before began; they are decoded again only as context, since
a token's text may depend on its neighbours. The text after the settled part is
`decode(tokens[prefix:])[len(decode(tokens[prefix:read])):]`. Once it no longer ends in U+FFFD the
offsets move on (prefix to read, read to the end); until then they stay, and the next tokens are
decoded together with the unfinished ones (an unfinished character decodes as one U+FFFD, so the
characters before it are final and may be released). `window` keeps just the text the stop strings
still need: the last characters released (as many as the longest stop string) and the settled text
not yet released.

A stop token (end of text, or one of the request's `stop_token_ids`) is reported among the token
ids but has no text, as in vLLM: the literal `<|endoftext|>` never reaches a client.

With `min_tokens`, a stop string must end in the text of a later token: `floor` is where the text
of the first min_tokens tokens ends (a chunk that straddles that token is split there, so the
outcome does not depend on how tokens are grouped into chunks).
"""
from __future__ import annotations

from baton.shared.model.tokenizer import TextTokenizer

REPLACEMENT = "\ufffd"


class TextStream:
    def __init__(self, tokenizer: TextTokenizer, stop: list[str], stop_token_ids: frozenset[int] = frozenset(),
                 min_tokens: int = 0) -> None:
        self.tokenizer, self.stop, self.stop_token_ids = tokenizer, stop, stop_token_ids
        self.unarmed = min_tokens  # tokens still to come that no stop string may end in
        self.floor = 0  # a stop string must end past this character of `window`
        self.tokens: list[int] = []
        self.prefix = self.read = 0  # token offsets, see the module docstring
        self.window = ""  # settled text of tokens[:read], less what no stop string can reach
        self.sent = 0  # characters from the start of `window` already released
        self.keep = max(map(len, stop), default=0)
        self.stopped = False

    def add(self, token_ids: list[int]) -> tuple[list[int], str]:
        """Feed new tokens; returns the tokens to report and the newly releasable text. After a
        stop string matched, `stopped` is True and later tokens are dropped."""
        if self.stopped:
            return [], ""
        if 0 < (n := self.unarmed) < len(token_ids):
            (head, head_text), (tail, tail_text) = self.add(token_ids[:n]), self.add(token_ids[n:])
            return head + tail, head_text + tail_text
        self.tokens.extend(t for t in token_ids if t not in self.stop_token_ids)
        text = self._decode()
        cut = None if self.unarmed else self._stop_at(text)
        if self.unarmed:
            self.unarmed -= len(token_ids)
            self.floor = len(text.removesuffix(REPLACEMENT))
        if cut is not None:
            self.stopped = True
            return token_ids, self._release(text[:cut])
        delta = self._release(text[:len(text) - self._holdback(text)])
        if not text.endswith(REPLACEMENT) and len(self.tokens) > self.read:  # settled: move on
            self.prefix, self.read = self.read, len(self.tokens)
            drop = max(0, self.sent - self.keep)
            self.window, self.sent, self.floor = text[drop:], self.sent - drop, max(0, self.floor - drop)
        return token_ids, delta

    def finish(self) -> str:
        """The rest of the text at the end of generation."""
        return "" if self.stopped else self._release(self._decode())

    @property
    def text(self) -> str:
        """All the text so far (decodes every token; for tests and debugging)."""
        return self.tokenizer.decode(self.tokens)

    def _decode(self) -> str:
        """The text from the start of `window` to the end of the tokens."""
        settled = self.tokenizer.decode(self.tokens[self.prefix:self.read]) if self.read > self.prefix else ""
        return self.window + self.tokenizer.decode(self.tokens[self.prefix:])[len(settled):]

    def _release(self, upto: str) -> str:
        delta = upto[self.sent:]
        self.sent = max(self.sent, len(upto))
        return delta

    def _stop_at(self, text: str) -> int | None:
        hits = [i for i in (text.find(s, max(0, self.sent - len(s), self.floor - len(s) + 1)) for s in self.stop)
                if i >= 0]
        return min(hits) if hits else None

    def _holdback(self, text: str) -> int:
        """How many trailing characters may still change: a partial character, and before it
        (the partial one may complete a stop string too) the longest start of a stop string."""
        partial = 1 if text.endswith(REPLACEMENT) else 0
        text, hold = text[:len(text) - partial], 0
        for s in self.stop:
            for n in range(len(s) - 1, 0, -1):
                if text.endswith(s[:n]):
                    hold = max(hold, n)
                    break
        return partial + hold
